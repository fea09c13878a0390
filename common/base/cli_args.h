// Minimal command-line parsing for the `shardcast` subcommands: declared
// options with help text, "--name value" / "--name=value" / "--flag", and
// positional arguments. A value that starts with '-' (like a negative layer)
// is taken as the value of the option before it.
#ifndef SHARDCAST_COMMON_BASE_CLI_ARGS_H_
#define SHARDCAST_COMMON_BASE_CLI_ARGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardcast {

/// One option a command accepts.
struct OptionSpec {
  const char* name;        // without the leading "--"
  const char* value_name;  // nullptr for a flag that takes no value
  const char* help;
  bool repeated = false;  // may be given several times
};

/// Parsed arguments of one command. Plain data.
class Args {
 public:
  /// Parses argv (without the program and command names). INVALID_ARGUMENT
  /// for unknown options, missing values or repeats of a non-repeated one.
  static absl::StatusOr<Args> Parse(const std::vector<std::string>& argv,
                                    const std::vector<OptionSpec>& specs);

  bool Has(const std::string& name) const { return values_.count(name) > 0; }
  /// Last value of `name`, or `fallback` when absent.
  std::string Get(const std::string& name,
                  const std::string& fallback = "") const;
  std::vector<std::string> GetAll(const std::string& name) const;
  /// Integer value; INVALID_ARGUMENT naming the option when not an integer.
  absl::StatusOr<int64_t> GetInt(const std::string& name,
                                 int64_t fallback) const;
  /// A byte count: an integer with an optional binary suffix K, M, G or T
  /// ("512M", "2G"). INVALID_ARGUMENT naming the option otherwise, or when
  /// it is negative or overflows.
  absl::StatusOr<uint64_t> GetBytes(const std::string& name,
                                    uint64_t fallback) const;
  /// Comma-separated integers ("-2,6,12").
  absl::StatusOr<std::vector<int64_t>> GetIntList(
      const std::string& name, const std::string& fallback) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
};

/// Parses a byte count: an integer with an optional binary suffix K, M, G
/// or T (either case). False for anything else, negatives and overflow.
bool ParseByteCount(absl::string_view text, uint64_t* out);

/// Formats the option list for --help.
std::string FormatOptions(const std::vector<OptionSpec>& specs);

}  // namespace shardcast

#endif  // SHARDCAST_COMMON_BASE_CLI_ARGS_H_
