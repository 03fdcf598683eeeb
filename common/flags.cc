#include "common/flags.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace epserve::common {

void FlagSet::AddChecked(std::string name, std::string help, std::string default_text, bool is_bool,
                         std::function<absl::Status(absl::string_view)> set) {
  flags_.push_back(
      {std::move(name), std::move(help), std::move(default_text), is_bool, std::move(set)});
}

void FlagSet::AddFlag(std::string name, std::string help, std::string default_text, bool is_bool,
                      std::function<bool(absl::string_view)> set) {
  AddChecked(std::move(name), std::move(help), std::move(default_text), is_bool,
             [set = std::move(set)](absl::string_view v) {
               return set(v) ? absl::OkStatus() : absl::InvalidArgumentError("");
             });
}

void FlagSet::Add(std::string name, std::string* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::StrCat("\"", *value, "\""), false,
          [value](absl::string_view v) {
            *value = std::string(v);
            return true;
          });
}

void FlagSet::Add(std::string name, int64_t* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::StrCat(*value), false,
          [value](absl::string_view v) { return absl::SimpleAtoi(v, value); });
}

void FlagSet::Add(std::string name, std::vector<int64_t>* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::StrCat("\"", absl::StrJoin(*value, ","), "\""),
          false, [value](absl::string_view v) {
            std::vector<int64_t> list;
            for (absl::string_view item : absl::StrSplit(v, ',', absl::SkipEmpty())) {
              int64_t x = 0;
              if (!absl::SimpleAtoi(item, &x)) return false;
              list.push_back(x);
            }
            *value = std::move(list);
            return true;
          });
}

void FlagSet::Add(std::string name, int* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::StrCat(*value), false,
          [value](absl::string_view v) { return absl::SimpleAtoi(v, value); });
}

void FlagSet::Add(std::string name, double* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::StrCat(*value), false,
          [value](absl::string_view v) { return absl::SimpleAtod(v, value); });
}

void FlagSet::Add(std::string name, bool* value, std::string help) {
  AddFlag(std::move(name), std::move(help), *value ? "true" : "false", true,
          [value](absl::string_view v) { return absl::SimpleAtob(v, value); });
}

void FlagSet::Add(std::string name, absl::Duration* value, std::string help) {
  AddFlag(std::move(name), std::move(help), absl::FormatDuration(*value), false,
          [value](absl::string_view v) { return absl::ParseDuration(v, value); });
}

void FlagSet::AddBytes(std::string name, int64_t* value, std::string help) {
  std::string default_text = *value == 0 ? "\"\"" : absl::StrCat(*value);
  const std::string flag = name;
  AddChecked(
      std::move(name), std::move(help), std::move(default_text), false,
      [value, flag](absl::string_view text) -> absl::Status {
        if (text.empty() || text == "0") {
          *value = 0;
          return absl::OkStatus();
        }
        // A binary suffix K, M, G or T (either case) scales by 2^10, 2^20, 2^30 or 2^40.
        int64_t scale = 1;
        absl::string_view digits = text;
        if (const size_t unit = absl::string_view("KMGT").find(absl::ascii_toupper(text.back()));
            unit != absl::string_view::npos) {
          scale = int64_t{1} << (10 * (unit + 1));
          digits.remove_suffix(1);
        }
        double v = 0;
        if (!absl::SimpleAtod(digits, &v) || v <= 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--", flag, " must be bytes with an optional K/M/G/T suffix, got '", text, "'"));
        }
        *value = static_cast<int64_t>(v * static_cast<double>(scale));
        return absl::OkStatus();
      });
}

absl::Status FlagSet::Parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      help_requested_ = true;
      return absl::OkStatus();
    }
    if (!absl::StartsWith(arg, "--")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "'; see --help"));
    }
    arg.remove_prefix(2);
    absl::string_view name = arg;
    absl::string_view value;
    bool has_value = false;
    if (size_t eq = arg.find('='); eq != absl::string_view::npos) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      has_value = true;
    }
    bool negated = false;
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
      if (f.is_bool && !has_value && absl::StrCat("no-", f.name) == name) {
        flag = &f;
        negated = true;
      }
    }
    if (flag == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name, "; see --help"));
    }
    if (!has_value) {
      if (flag->is_bool) {
        value = negated ? "false" : "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("flag --", name, " needs a value"));
      }
    }
    if (absl::Status s = flag->set(value); !s.ok()) {
      if (!s.message().empty()) return s;  // the flag's own words
      return absl::InvalidArgumentError(absl::StrCat("bad value '", value, "' for --", flag->name,
                                                     " (default ", flag->default_text, ")"));
    }
  }
  return absl::OkStatus();
}

std::string FlagSet::Usage() const {
  std::string out = absl::StrCat("Usage: ", program_, " [flags]\n", summary_, "\n\nFlags:\n");
  for (const Flag& f : flags_) {
    absl::StrAppend(&out, "  --", f.name, "  (default: ", f.default_text, ")\n      ", f.help,
                    "\n");
  }
  return out;
}

}  // namespace epserve::common
