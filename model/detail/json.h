// A small strict JSON reader for config.json, model.safetensors.index.json and safetensors
// headers (RFC 8259, plus the NaN / Infinity / -Infinity literals Python's json module
// writes). Duplicate object keys are an error. Integers are kept exactly up to 64 bits.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace epserve::model::detail {

// An immutable parsed JSON value. Thread-compatible (const access is thread-safe).
class Json {
 public:
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

  Json() = default;

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }
  // True for a number written without fraction or exponent that fits in int64.
  bool is_integer() const { return type_ == Type::kNumber && exact_int_; }

  bool bool_value() const { return bool_; }
  double number() const { return number_; }
  int64_t integer() const { return int_; }
  const std::string& string() const { return string_; }
  const std::vector<Json>& array() const { return array_; }
  // Members in document order.
  const std::vector<std::pair<std::string, Json>>& members() const { return members_; }
  // The member named `key`, or nullptr.
  const Json* Find(absl::string_view key) const;

  static absl::string_view TypeName(Type type);

 private:
  friend class JsonParser;
  Type type_ = Type::kNull;
  bool bool_ = false;
  bool exact_int_ = false;
  double number_ = 0.0;
  int64_t int_ = 0;
  std::string string_;
  std::vector<Json> array_;
  std::vector<std::pair<std::string, Json>> members_;
};

// Parses one JSON value; only whitespace may follow it. Errors are INVALID_ARGUMENT with
// the byte offset of the problem.
absl::StatusOr<Json> ParseJson(absl::string_view text);

}  // namespace epserve::model::detail
