#include "model/detail/json.h"

#include <cmath>
#include <limits>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace epserve::model::detail {

const Json* Json::Find(absl::string_view key) const {
  for (const auto& [name, value] : members_)
    if (name == key) return &value;
  return nullptr;
}

absl::string_view Json::TypeName(Type type) {
  switch (type) {
    case Type::kNull:
      return "null";
    case Type::kBool:
      return "boolean";
    case Type::kNumber:
      return "number";
    case Type::kString:
      return "string";
    case Type::kArray:
      return "array";
    case Type::kObject:
      return "object";
  }
  return "unknown";
}

class JsonParser {
 public:
  explicit JsonParser(absl::string_view text) : text_(text) {}

  absl::StatusOr<Json> ParseDocument() {
    Json value;
    if (absl::Status s = ParseValue(value, 0); !s.ok()) return s;
    SkipSpace();
    if (pos_ != text_.size()) return Error("unexpected text after the JSON value");
    return value;
  }

 private:
  static constexpr int kMaxDepth = 64;

  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("JSON error at byte ", pos_, ": ", what));
  }

  void SkipSpace() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r'))
      ++pos_;
  }

  bool Consume(absl::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status ParseValue(Json& out, int depth) {
    if (depth > kMaxDepth) return Error("nesting deeper than 64 levels");
    SkipSpace();
    if (pos_ >= text_.size()) return Error("unexpected end of text");
    const char c = text_[pos_];
    if (c == '{') return ParseObject(out, depth);
    if (c == '[') return ParseArray(out, depth);
    if (c == '"') {
      out.type_ = Json::Type::kString;
      return ParseString(out.string_);
    }
    if (Consume("true")) {
      out.type_ = Json::Type::kBool;
      out.bool_ = true;
      return absl::OkStatus();
    }
    if (Consume("false")) {
      out.type_ = Json::Type::kBool;
      return absl::OkStatus();
    }
    if (Consume("null")) return absl::OkStatus();
    // Python's json module writes these for non-finite floats.
    if (Consume("NaN")) return SetNumber(out, std::numeric_limits<double>::quiet_NaN());
    if (Consume("Infinity")) return SetNumber(out, std::numeric_limits<double>::infinity());
    if (Consume("-Infinity")) return SetNumber(out, -std::numeric_limits<double>::infinity());
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(out);
    return Error(absl::StrCat("unexpected character '", absl::string_view(&c, 1), "'"));
  }

  static absl::Status SetNumber(Json& out, double v) {
    out.type_ = Json::Type::kNumber;
    out.number_ = v;
    return absl::OkStatus();
  }

  absl::Status ParseNumber(Json& out) {
    const size_t start = pos_;
    auto digits = [&] {
      const size_t from = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      return pos_ - from;
    };
    if (text_[pos_] == '-') ++pos_;
    if (pos_ < text_.size() && text_[pos_] == '0') {
      ++pos_;
    } else if (digits() == 0) {
      return Error("malformed number");
    }
    bool integral = true;
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (digits() == 0) return Error("malformed number: no digits after '.'");
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("malformed number: no digits in the exponent");
    }
    const absl::string_view literal = text_.substr(start, pos_ - start);
    out.type_ = Json::Type::kNumber;
    if (!absl::SimpleAtod(literal, &out.number_)) return Error("malformed number");
    if (integral && absl::SimpleAtoi(literal, &out.int_)) out.exact_int_ = true;
    return absl::OkStatus();
  }

  absl::Status ParseHex4(uint32_t& v) {
    if (pos_ + 4 > text_.size()) return Error("truncated \\u escape");
    v = 0;
    for (int i = 0; i < 4; ++i) {
      const char h = text_[pos_++];
      v <<= 4;
      if (h >= '0' && h <= '9') {
        v |= h - '0';
      } else if (h >= 'a' && h <= 'f') {
        v |= h - 'a' + 10;
      } else if (h >= 'A' && h <= 'F') {
        v |= h - 'A' + 10;
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    return absl::OkStatus();
  }

  static void AppendUtf8(std::string& s, uint32_t cp) {
    if (cp < 0x80) {
      s += static_cast<char>(cp);
    } else if (cp < 0x800) {
      s += static_cast<char>(0xC0 | (cp >> 6));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      s += static_cast<char>(0xE0 | (cp >> 12));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      s += static_cast<char>(0xF0 | (cp >> 18));
      s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      s += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  absl::Status ParseString(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= text_.size()) return Error("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return absl::OkStatus();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) return Error("unterminated escape");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = 0;
          if (absl::Status s = ParseHex4(cp); !s.ok()) return s;
          if (cp >= 0xD800 && cp < 0xDC00) {
            uint32_t low = 0;
            if (!Consume("\\u")) return Error("unpaired surrogate in \\u escape");
            if (absl::Status s = ParseHex4(low); !s.ok()) return s;
            if (low < 0xDC00 || low >= 0xE000) return Error("unpaired surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            return Error("unpaired surrogate in \\u escape");
          }
          AppendUtf8(out, cp);
          break;
        }
        default:
          return Error("bad escape in string");
      }
    }
  }

  absl::Status ParseArray(Json& out, int depth) {
    out.type_ = Json::Type::kArray;
    ++pos_;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      out.array_.emplace_back();
      if (absl::Status s = ParseValue(out.array_.back(), depth + 1); !s.ok()) return s;
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unterminated array");
      const char c = text_[pos_++];
      if (c == ']') return absl::OkStatus();
      if (c != ',') return Error("expected ',' or ']' in array");
    }
  }

  absl::Status ParseObject(Json& out, int depth) {
    out.type_ = Json::Type::kObject;
    ++pos_;
    SkipSpace();
    if (pos_ < text_.size() && text_[pos_] == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    std::unordered_set<std::string> seen;
    while (true) {
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != '"') return Error("expected a member name");
      std::string key;
      if (absl::Status s = ParseString(key); !s.ok()) return s;
      if (!seen.insert(key).second) return Error(absl::StrCat("duplicate key \"", key, "\""));
      SkipSpace();
      if (pos_ >= text_.size() || text_[pos_] != ':') return Error("expected ':' after a name");
      ++pos_;
      Json value;
      if (absl::Status s = ParseValue(value, depth + 1); !s.ok()) return s;
      out.members_.emplace_back(std::move(key), std::move(value));
      SkipSpace();
      if (pos_ >= text_.size()) return Error("unterminated object");
      const char c = text_[pos_++];
      if (c == '}') return absl::OkStatus();
      if (c != ',') return Error("expected ',' or '}' in object");
    }
  }

  absl::string_view text_;
  size_t pos_ = 0;
};

absl::StatusOr<Json> ParseJson(absl::string_view text) { return JsonParser(text).ParseDocument(); }

}  // namespace epserve::model::detail
