// Command-line flags spelled the Unix way (--max-batch-tokens=512 or --max-batch-tokens 512),
// each with a type, a default and a help line. Configuration-time only; not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace epserve::common {

class FlagSet {
 public:
  explicit FlagSet(std::string program, std::string summary)
      : program_(std::move(program)), summary_(std::move(summary)) {}

  // Registers a flag bound to `*value`, whose current value is the default.
  void Add(std::string name, std::string* value, std::string help);
  void Add(std::string name, int64_t* value, std::string help);
  void Add(std::string name, int* value, std::string help);
  void Add(std::string name, double* value, std::string help);
  void Add(std::string name, bool* value, std::string help);  // --x, --x=true|false, --no-x
  void Add(std::string name, absl::Duration* value, std::string help);  // "500ms", "30s"
  // A comma list of integers ("1,8,32"); an empty value gives an empty list.
  void Add(std::string name, std::vector<int64_t>* value, std::string help);

  // Parses argv. Unknown flags, missing or malformed values and positional arguments are
  // INVALID_ARGUMENT naming the flag. `--help` sets help_requested() and stops parsing.
  absl::Status Parse(int argc, char** argv);
  bool help_requested() const { return help_requested_; }
  std::string Usage() const;

 private:
  struct Flag {
    std::string name;
    std::string help;
    std::string default_text;
    bool is_bool = false;
    std::function<bool(absl::string_view)> set;
  };
  void AddFlag(std::string name, std::string help, std::string default_text, bool is_bool,
               std::function<bool(absl::string_view)> set);

  std::string program_;
  std::string summary_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

}  // namespace epserve::common
