#include "model/memory.h"

#include <cstdio>
#include <fstream>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/share.h"
#include "model/layers.h"
#include "model/weights.h"

namespace epserve::model {

absl::StatusOr<RankMemory> EstimateRankBytes(const ModelConfig& config, int num_workers, int worker,
                                             bool shared_split, int redundant) {
  const MoeLayerConfig& c = config.layer;
  if (num_workers < 1 || num_workers > c.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker count must be in [1, num_experts=", c.num_experts, "], got ", num_workers));
  }
  if (worker < 0 || worker >= num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker must be in [0, ", num_workers, "), got ", worker));
  }
  // The shared expert this worker holds: all of it, or its slice of the columns.
  MoeLayerConfig held = c;
  if (shared_split) {
    held.shared_ffn_size = common::ContiguousShare(c.shared_ffn_size, worker, num_workers).size();
  }
  auto numel = [&](TensorKind kind) { return ShapeOf(held, kind).numel(); };
  RankMemory m;
  const common::Share own = common::ContiguousShare(c.num_experts, worker, num_workers);
  m.first_expert = static_cast<int>(own.begin);
  m.num_experts = static_cast<int>(own.size());
  if (redundant < 0 || redundant > c.num_experts * (num_workers - 1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("redundant experts must be in [0, experts x (workers - 1) = ",
                     c.num_experts * (num_workers - 1), "], got ", redundant));
  }
  if (redundant > 0) {
    const int slots = c.num_experts + redundant;
    m.first_expert = -1;
    m.num_experts = slots / num_workers + (worker < slots % num_workers ? 1 : 0);
  }
  m.num_layers = static_cast<int>(config.moe_layers.size());
  const int64_t layers = m.num_layers;
  m.router_params = layers * (numel(TensorKind::kRouter) + numel(TensorKind::kRouterBias));
  m.expert_params = layers * m.num_experts *
                    (numel(TensorKind::kExpertGate) + numel(TensorKind::kExpertUp) +
                     numel(TensorKind::kExpertDown));
  m.shared_params =
      layers * (numel(TensorKind::kSharedGate) + numel(TensorKind::kSharedUp) +
                numel(TensorKind::kSharedDown) + numel(TensorKind::kSharedExpertGate));
  return m;
}

std::string FormatBytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = 0;
  while (v >= 1024.0 && unit < 5) {
    v /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  char buf[32];
  std::snprintf(buf, sizeof(buf),
                v < 10    ? "%.2f %s"
                : v < 100 ? "%.1f %s"
                          : "%.0f %s",
                v, kUnits[unit]);
  return buf;
}

absl::StatusOr<int64_t> MachineMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  int64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemTotal:") return kib * 1024;
    meminfo.ignore(1 << 10, '\n');
  }
  return absl::FailedPreconditionError(
      "cannot read MemTotal from /proc/meminfo; set --memory-limit");
}

absl::Status CheckHostMemory(const HostMemoryCheck& check, std::span<const HostRank> ranks) {
  int64_t limit = check.limit_bytes;
  if (limit == 0) {
    absl::StatusOr<int64_t> machine = MachineMemoryBytes();
    if (!machine.ok()) return machine.status();
    limit = *machine;
  }
  const bool bf16 = check.weight_dtype == common::ElementType::kBf16;
  int64_t need = check.heap_bytes * static_cast<int64_t>(ranks.size());
  std::string parts;
  for (const HostRank& r : ranks) {
    if (r.worker < 0) continue;  // the front-end holds no expert weights
    absl::StatusOr<RankMemory> m = EstimateRankBytes(*check.config, check.num_workers, r.worker,
                                                     check.shared_split, check.redundant);
    if (!m.ok()) return m.status();
    const int64_t weight_bytes = bf16 ? m->bf16_bytes() + 2 * m->router_params : m->fp32_bytes();
    need += weight_bytes;
    absl::StrAppend(&parts, parts.empty() ? "" : ", ", "rank ", r.rank, " ",
                    FormatBytes(weight_bytes));
  }
  if (need <= limit) return absl::OkStatus();
  return absl::ResourceExhaustedError(
      absl::StrCat("the ranks on this host need ", FormatBytes(need), " (", bf16 ? "BF16" : "FP32",
                   " weights: ", parts, "; heap ", FormatBytes(check.heap_bytes), " per rank x ",
                   ranks.size(), ") but --memory-limit is ", FormatBytes(limit),
                   ": use more workers or hosts, fewer --layers, or a larger limit"));
}

}  // namespace epserve::model
