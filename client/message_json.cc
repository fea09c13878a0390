#include "client/message_json_internal.h"

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"

namespace shardcast {
namespace internal_client {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

// A JSON string: quote, backslash and control characters escaped; the rest
// (proto3 strings are UTF-8) as is.
void AppendString(std::string& out, const std::string& s) {
  out += '"';
  for (const char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void AppendDouble(std::string& out, double v) {
  if (!std::isfinite(v)) {
    out += "null";
    return;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  out += buf;
}

void AppendMessage(std::string& out, const Message& m);

// One value of `f` (element `i` of a repeated field, or -1 for a singular).
void AppendValue(std::string& out, const Message& m, const FieldDescriptor* f,
                 int i) {
  const Reflection* r = m.GetReflection();
  const bool rep = i >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      absl::StrAppend(&out, rep ? r->GetRepeatedInt32(m, f, i)
                                : r->GetInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_INT64:
      absl::StrAppend(&out, rep ? r->GetRepeatedInt64(m, f, i)
                                : r->GetInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      absl::StrAppend(&out, rep ? r->GetRepeatedUInt32(m, f, i)
                                : r->GetUInt32(m, f));
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      absl::StrAppend(&out, rep ? r->GetRepeatedUInt64(m, f, i)
                                : r->GetUInt64(m, f));
      break;
    case FieldDescriptor::CPPTYPE_DOUBLE:
      AppendDouble(out, rep ? r->GetRepeatedDouble(m, f, i)
                            : r->GetDouble(m, f));
      break;
    case FieldDescriptor::CPPTYPE_FLOAT:
      AppendDouble(out, rep ? r->GetRepeatedFloat(m, f, i)
                            : r->GetFloat(m, f));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      out += (rep ? r->GetRepeatedBool(m, f, i) : r->GetBool(m, f)) ? "true"
                                                                    : "false";
      break;
    case FieldDescriptor::CPPTYPE_ENUM:
      AppendString(out, std::string((rep ? r->GetRepeatedEnum(m, f, i)
                                         : r->GetEnum(m, f))
                                        ->name()));
      break;
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s =
          rep ? r->GetRepeatedString(m, f, i) : r->GetString(m, f);
      AppendString(out, f->type() == FieldDescriptor::TYPE_BYTES
                            ? absl::Base64Escape(s)
                            : s);
      break;
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      AppendMessage(out, rep ? r->GetRepeatedMessage(m, f, i)
                             : r->GetMessage(m, f));
      break;
  }
}

void AppendMessage(std::string& out, const Message& m) {
  const google::protobuf::Descriptor* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  out += '{';
  for (int k = 0; k < d->field_count(); ++k) {
    const FieldDescriptor* f = d->field(k);
    if (k > 0) out += ',';
    AppendString(out, std::string(f->name()));
    out += ':';
    if (f->is_map()) {
      // Maps as a list of {key, value} entries: no status message has one.
      out += '[';
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        if (i > 0) out += ',';
        AppendMessage(out, r->GetRepeatedMessage(m, f, i));
      }
      out += ']';
    } else if (f->is_repeated()) {
      out += '[';
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        if (i > 0) out += ',';
        AppendValue(out, m, f, i);
      }
      out += ']';
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
               !r->HasField(m, f)) {
      out += "null";
    } else {
      AppendValue(out, m, f, -1);
    }
  }
  out += '}';
}

}  // namespace

std::string MessageJson(const Message& message) {
  std::string out;
  AppendMessage(out, message);
  return out;
}

}  // namespace internal_client
}  // namespace shardcast
