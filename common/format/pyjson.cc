#include "common/format/pyjson.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/limits.h"

namespace shardcast {
namespace {

// nlohmann's DOM builder, except that a number written without '.', 'e' or
// 'E' that did not fit in 64 bits (so nlohmann turned it into a double) is an
// error: Python would keep it as an exact integer and hash it differently.
class StrictDomParser : public nlohmann::detail::json_sax_dom_parser<Json> {
 public:
  using Base = nlohmann::detail::json_sax_dom_parser<Json>;
  using Base::Base;

  bool number_float(Json::number_float_t value, const std::string& raw) {
    if (raw.find_first_of(".eE") == std::string::npos) {
      overflow_text_ = raw;
      return false;
    }
    return Base::number_float(value, raw);
  }

  // Nesting is bounded (limits::kMaxJsonDepth): everything that walks a
  // Json later (hashing, dump, destruction) recurses once per level.
  bool start_object(std::size_t n) { return Deeper() && Base::start_object(n); }
  bool start_array(std::size_t n) { return Deeper() && Base::start_array(n); }
  bool end_object() {
    --depth_;
    return Base::end_object();
  }
  bool end_array() {
    --depth_;
    return Base::end_array();
  }

  const std::string& overflow_text() const { return overflow_text_; }
  bool too_deep() const { return too_deep_; }

 private:
  bool Deeper() {
    if (++depth_ <= limits::kMaxJsonDepth) return true;
    too_deep_ = true;
    return false;
  }

  std::string overflow_text_;
  int depth_ = 0;
  bool too_deep_ = false;
};

void AppendHex4(std::string& out, unsigned value) {
  absl::StrAppendFormat(&out, "\\u%04x", value);
}

// Decodes one UTF-8 sequence starting at s[i]; nlohmann has already validated
// the encoding when parsing, and strings built in code are ASCII or UTF-8.
uint32_t DecodeUtf8(absl::string_view s, size_t& i) {
  const unsigned char c = static_cast<unsigned char>(s[i]);
  int extra = 0;
  uint32_t cp = c;
  if (c >= 0xF0) {
    extra = 3;
    cp = c & 0x07;
  } else if (c >= 0xE0) {
    extra = 2;
    cp = c & 0x0F;
  } else if (c >= 0xC0) {
    extra = 1;
    cp = c & 0x1F;
  }
  for (int k = 0; k < extra && i + 1 < s.size(); ++k) {
    ++i;
    cp = (cp << 6) | (static_cast<unsigned char>(s[i]) & 0x3F);
  }
  ++i;
  return cp;
}

void AppendPyString(std::string& out, absl::string_view s, bool ensure_ascii) {
  out.push_back('"');
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        ++i;
        continue;
      case '\\':
        out += "\\\\";
        ++i;
        continue;
      case '\n':
        out += "\\n";
        ++i;
        continue;
      case '\r':
        out += "\\r";
        ++i;
        continue;
      case '\t':
        out += "\\t";
        ++i;
        continue;
      case '\b':
        out += "\\b";
        ++i;
        continue;
      case '\f':
        out += "\\f";
        ++i;
        continue;
      default:
        break;
    }
    if (c < 0x20) {
      AppendHex4(out, c);
      ++i;
    } else if (c < 0x7F) {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (!ensure_ascii) {
      // ensure_ascii=False keeps DEL and non-ASCII bytes as they are.
      out.push_back(static_cast<char>(c));
      ++i;
    } else {
      const uint32_t cp = DecodeUtf8(s, i);
      if (cp >= 0x10000) {
        const uint32_t v = cp - 0x10000;
        AppendHex4(out, 0xD800 | (v >> 10));
        AppendHex4(out, 0xDC00 | (v & 0x3FF));
      } else {
        AppendHex4(out, cp);
      }
    }
  }
  out.push_back('"');
}

void AppendValue(std::string& out, const Json& value,
                 const PyJsonOptions& options, int depth);

void AppendNewline(std::string& out, const PyJsonOptions& options, int depth) {
  if (options.indent < 0) return;
  out.push_back('\n');
  out.append(static_cast<size_t>(options.indent) * depth, ' ');
}

void AppendValue(std::string& out, const Json& value,
                 const PyJsonOptions& options, int depth) {
  const char* item_sep = ",";
  const char* key_sep = options.indent < 0 ? ":" : ": ";
  switch (value.type()) {
    case Json::value_t::null:
      out += "null";
      return;
    case Json::value_t::boolean:
      out += value.get<bool>() ? "true" : "false";
      return;
    case Json::value_t::number_integer:
      absl::StrAppend(&out, value.get<int64_t>());
      return;
    case Json::value_t::number_unsigned:
      absl::StrAppend(&out, value.get<uint64_t>());
      return;
    case Json::value_t::number_float: {
      const double d = value.get<double>();
      // json.dumps spells the non-finite floats like JavaScript does.
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        out += PyFloatRepr(d);
      }
      return;
    }
    case Json::value_t::string:
      AppendPyString(out, value.get_ref<const std::string&>(),
                     options.ensure_ascii);
      return;
    case Json::value_t::array: {
      if (value.empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      bool first = true;
      for (const Json& item : value) {
        if (!first) out += item_sep;
        first = false;
        AppendNewline(out, options, depth + 1);
        AppendValue(out, item, options, depth + 1);
      }
      AppendNewline(out, options, depth);
      out.push_back(']');
      return;
    }
    case Json::value_t::object: {
      if (value.empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<const std::string*, const Json*>> items;
      items.reserve(value.size());
      for (auto it = value.begin(); it != value.end(); ++it) {
        items.emplace_back(&it.key(), &it.value());
      }
      if (options.sort_keys) {
        // Byte order of UTF-8 equals code point order, which is how Python
        // sorts str keys.
        std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) {
          return *a.first < *b.first;
        });
      }
      out.push_back('{');
      bool first = true;
      for (const auto& [key, item] : items) {
        if (!first) out += item_sep;
        first = false;
        AppendNewline(out, options, depth + 1);
        AppendPyString(out, *key, options.ensure_ascii);
        out += key_sep;
        AppendValue(out, *item, options, depth + 1);
      }
      AppendNewline(out, options, depth);
      out.push_back('}');
      return;
    }
    case Json::value_t::binary:
    case Json::value_t::discarded:
      out += "null";
      return;
  }
}

}  // namespace

absl::StatusOr<Json> ParseJson(absl::string_view text,
                               absl::string_view source) {
  if (text.size() > limits::kMaxJsonBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        source, ": ", text.size(), " bytes of JSON; at most ",
        limits::kMaxJsonBytes, " are read (common/base/limits.h)"));
  }
  Json result;
  StrictDomParser parser(result, /*allow_exceptions=*/true);
  try {
    const bool ok = Json::sax_parse(text.begin(), text.end(), &parser);
    if (!ok) {
      if (parser.too_deep()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": JSON nested deeper than ",
                         limits::kMaxJsonDepth, " levels"));
      }
      if (!parser.overflow_text().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": integer ", parser.overflow_text(),
                         " does not fit in 64 bits"));
      }
      return absl::InvalidArgumentError(absl::StrCat(source, ": invalid JSON"));
    }
  } catch (const Json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, ": invalid JSON: ", e.what()));
  }
  return result;
}

std::string PyJsonDumps(const Json& value, const PyJsonOptions& options) {
  std::string out;
  AppendValue(out, value, options, 0);
  return out;
}

bool IsValidUtf8(absl::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    int extra;
    uint32_t min;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      extra = 1;
      min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2;
      min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3;
      min = 0x10000;
    } else {
      return false;
    }
    if (i + static_cast<size_t>(extra) >= text.size())
      return false;  // truncated
    uint32_t cp = c & (0x3F >> extra);
    for (int k = 1; k <= extra; ++k) {
      const unsigned char cc =
          static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    // Overlong forms, surrogates and values past U+10FFFF are not UTF-8.
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += static_cast<size_t>(extra) + 1;
  }
  return true;
}

std::string JsonText(const Json& j, int indent) {
  return j.dump(indent, ' ', /*ensure_ascii=*/false,
                Json::error_handler_t::replace);
}

std::string ValidUtf8(absl::string_view text) {
  // Serialising a JSON string with the replace handler does the validation;
  // strip the quotes and undo the escaping by parsing it back.
  const std::string quoted =
      Json(std::string(text))
          .dump(-1, ' ', false, Json::error_handler_t::replace);
  return Json::parse(quoted).get<std::string>();
}

std::string PyFloatRepr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  std::string out;
  if (std::signbit(value)) {
    out.push_back('-');
    value = -value;
  }
  if (value == 0.0) return out + "0.0";

  // Shortest round-trip digits in scientific form: d[.ddd]e[+-]XX.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), value,
                           std::chars_format::scientific);
  absl::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  const size_t e_pos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e_pos)) {
    if (c != '.') digits.push_back(c);
  }
  const int exponent = std::atoi(std::string(sci.substr(e_pos + 1)).c_str());
  // Python's float_repr_style 'short' with repr rules: decpt is the position
  // of the decimal point relative to the digit string.
  const int decpt = exponent + 1;
  const int ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out.push_back(digits[0]);
    if (ndigits > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    absl::StrAppendFormat(&out, "e%c%02d", exponent < 0 ? '-' : '+',
                          std::abs(exponent));
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= ndigits) {
    out += digits;
    out.append(static_cast<size_t>(decpt - ndigits), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<size_t>(decpt));
    out.push_back('.');
    out.append(digits, static_cast<size_t>(decpt), std::string::npos);
  }
  return out;
}

absl::string_view JsonTypeName(const Json& v) {
  switch (v.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned:
      return "an integer";
    case Json::value_t::number_float:
      return "a float";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "an unsupported value";
  }
}

}  // namespace shardcast
