// The named regions of one kind of shared memory (system, CUDA) under Triton's rules for them:
// one region per name, unregistering an unknown name is no error, an empty name unregisters
// every region, and a lookup or status of an unknown name is NOT_FOUND naming it. Not
// thread-safe: the registry that holds one guards it with its own mutex.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "server/clip.h"

namespace epserve::server {

template <typename Region>
class RegionMap {
 public:
  bool contains(const std::string& name) const { return regions_.count(name) > 0; }
  size_t size() const { return regions_.size(); }
  // False (and nothing added) when the name is in use.
  bool Insert(const std::string& name, std::shared_ptr<const Region> region) {
    return regions_.emplace(name, std::move(region)).second;
  }
  // Forgets `name`; every region when it is empty.
  void Remove(const std::string& name) {
    if (name.empty()) {
      regions_.clear();
    } else {
      regions_.erase(name);  // an unknown name is no error (Triton's rule)
    }
  }
  absl::StatusOr<std::shared_ptr<const Region>> Find(const std::string& name) const {
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(
          absl::StrCat("no shared memory region '", Clip(name), "' is registered"));
    }
    return it->second;
  }
  // status_of(region) of every region (name empty) or of the one named; NOT_FOUND naming it
  // ("no <kind>shared memory region ...") for an unknown name.
  template <typename StatusOf>
  auto Statuses(const std::string& name, absl::string_view kind, StatusOf status_of) const
      -> absl::StatusOr<std::vector<std::invoke_result_t<StatusOf, const Region&>>> {
    std::vector<std::invoke_result_t<StatusOf, const Region&>> out;
    for (const auto& [n, r] : regions_) {
      if (name.empty() || n == name) out.push_back(status_of(*r));
    }
    if (!name.empty() && out.empty()) {
      return absl::NotFoundError(
          absl::StrCat("no ", kind, "shared memory region '", Clip(name), "' is registered"));
    }
    return out;
  }

 private:
  std::map<std::string, std::shared_ptr<const Region>> regions_;
};

}  // namespace epserve::server
