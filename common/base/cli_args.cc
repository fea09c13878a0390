#include "common/base/cli_args.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace shardcast {

absl::StatusOr<Args> Args::Parse(const std::vector<std::string>& argv,
                                 const std::vector<OptionSpec>& specs) {
  Args args;
  bool options_done = false;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& arg = argv[i];
    if (options_done || !absl::StartsWith(arg, "--") || arg == "-") {
      args.positional_.push_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_inline_value = false;
    if (size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline_value = true;
    }
    const OptionSpec* spec = nullptr;
    for (const OptionSpec& s : specs) {
      if (name == s.name) spec = &s;
    }
    if (spec == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown option --", name));
    }
    if (spec->value_name == nullptr) {
      if (has_inline_value) {
        return absl::InvalidArgumentError(
            absl::StrCat("option --", name, " takes no value"));
      }
    } else if (!has_inline_value) {
      if (i + 1 >= argv.size()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "option --", name, " needs a value (", spec->value_name, ")"));
      }
      value = argv[++i];
    }
    if (!spec->repeated && args.values_.count(name) > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("option --", name, " given twice"));
    }
    args.values_[name].push_back(value);
  }
  return args;
}

std::string Args::Get(const std::string& name,
                      const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

std::vector<std::string> Args::GetAll(const std::string& name) const {
  auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

absl::StatusOr<int64_t> Args::GetInt(const std::string& name,
                                     int64_t fallback) const {
  if (!Has(name)) return fallback;
  int64_t v;
  if (!absl::SimpleAtoi(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", name, " must be an integer, got \"", Get(name), "\""));
  }
  return v;
}

bool ParseByteCount(absl::string_view text, uint64_t* out) {
  int shift = 0;
  if (!text.empty()) {
    switch (text.back()) {
      case 'K':
      case 'k':
        shift = 10;
        break;
      case 'M':
      case 'm':
        shift = 20;
        break;
      case 'G':
      case 'g':
        shift = 30;
        break;
      case 'T':
      case 't':
        shift = 40;
        break;
      default:
        break;
    }
  }
  if (shift > 0) text.remove_suffix(1);
  uint64_t v;
  if (text.empty() || text[0] == '-' || !absl::SimpleAtoi(text, &v) ||
      (shift > 0 && v > (UINT64_MAX >> shift))) {
    return false;
  }
  *out = v << shift;
  return true;
}

absl::StatusOr<uint64_t> Args::GetBytes(const std::string& name,
                                        uint64_t fallback) const {
  if (!Has(name)) return fallback;
  uint64_t v;
  if (!ParseByteCount(Get(name), &v)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", name, " must be a byte count like 1073741824, 512M or 2G, got \"",
        Get(name), "\""));
  }
  return v;
}

absl::StatusOr<std::vector<int64_t>> Args::GetIntList(
    const std::string& name, const std::string& fallback) const {
  const std::string text = Get(name, fallback);
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int64_t v;
    if (!absl::SimpleAtoi(part, &v)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--", name, " must be comma-separated integers, got \"", text, "\""));
    }
    out.push_back(v);
  }
  return out;
}

std::string FormatOptions(const std::vector<OptionSpec>& specs) {
  std::string out = "Options:\n";
  for (const OptionSpec& s : specs) {
    std::string left = absl::StrCat("  --", s.name);
    if (s.value_name != nullptr) absl::StrAppend(&left, " ", s.value_name);
    if (left.size() < 28) {
      left.resize(28, ' ');
    } else {
      absl::StrAppend(&left, "\n", std::string(28, ' '));
    }
    absl::StrAppend(&out, left, s.help, "\n");
  }
  absl::StrAppend(&out, "  --help                    show this help\n");
  return out;
}

}  // namespace shardcast
