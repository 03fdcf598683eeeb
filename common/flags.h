// Command-line flags spelled the Unix way (--max-batch-tokens=512 or --max-batch-tokens 512),
// each with a type, a default and a help line. Configuration-time only; not thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
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
  // A byte count: digits (a fraction allowed) with an optional binary suffix K, M, G or T
  // (either case: 2^10 .. 2^40), more than 0; "" and "0" give 0, which the flag's reader
  // defines ("64G", "1.5M", "1048576").
  void AddBytes(std::string name, int64_t* value, std::string help);

  // A flag of any type (an enum, an element type): `parse` turns the text into the value, or
  // gives an error naming the flag and what it accepts, which Parse returns as it is;
  // `format` shows the default in Usage. A `switch_flag` is spelled like a bool flag (--x,
  // --no-x, --x=true|false), `parse` then getting "true" or "false" for the bare forms.
  template <typename T>
  void AddTyped(std::string name, T* value, std::string help,
                std::function<absl::StatusOr<T>(absl::string_view)> parse,
                std::function<std::string(const T&)> format, bool switch_flag = false) {
    std::string default_text = format(*value);
    AddChecked(std::move(name), std::move(help), std::move(default_text), switch_flag,
               [value, parse = std::move(parse)](absl::string_view text) -> absl::Status {
                 absl::StatusOr<T> parsed = parse(text);
                 if (!parsed.ok()) return parsed.status();
                 *value = *std::move(parsed);
                 return absl::OkStatus();
               });
  }

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
    // An error with an empty message: Parse names the flag, the value and the default.
    std::function<absl::Status(absl::string_view)> set;
  };
  void AddChecked(std::string name, std::string help, std::string default_text, bool is_bool,
                  std::function<absl::Status(absl::string_view)> set);
  // AddChecked for a parser that only says whether the text was good.
  void AddFlag(std::string name, std::string help, std::string default_text, bool is_bool,
               std::function<bool(absl::string_view)> set);

  std::string program_;
  std::string summary_;
  std::vector<Flag> flags_;
  bool help_requested_ = false;
};

}  // namespace epserve::common
