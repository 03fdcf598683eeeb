// The exchange's row moves between devices' memory (kernels/moe_kernels.h: CopyRows,
// CopyRowRuns, ReturnRows; kernels/cl/combine.cl).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/launch.h"
#include "kernels/moe_kernels.h"

namespace epserve::kernels {

using detail::LaunchBounded;
using detail::NeedBytes;
using detail::NeedIntRange;
using detail::SetArgs;

namespace {

// Whether row moves take copy_runs_grouped (CopyRowRuns).
bool RowRunsGrouped(const Runtime& rt, int64_t hidden, int64_t groups) {
  return hidden % 4 == 0 && (groups > 0 || (groups == 0 && !rt.device_info().is_cpu));
}

// A block run outside the grouped form: one copy of the rows inside both buffers.
absl::Status CopyBlock(Runtime& rt, const RowRun& run, int64_t hidden) {
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t src_rows = static_cast<int64_t>(run.src->bytes() / row_bytes);
  const int64_t dst_rows = static_cast<int64_t>(run.dst->bytes() / row_bytes);
  const int64_t rows = std::min({run.count, src_rows - run.block_src, dst_rows - run.block_dst});
  if (rows <= 0) return absl::OkStatus();
  CL_CHECK(clEnqueueCopyBuffer(rt.launch_queue(), run.src->mem(), run.dst->mem(),
                               static_cast<size_t>(run.block_src) * row_bytes,
                               static_cast<size_t>(run.block_dst) * row_bytes,
                               static_cast<size_t>(rows) * row_bytes, 0, nullptr, nullptr));
  return absl::OkStatus();
}

// One copy_runs_grouped launch's runs, as its arguments hold them.
struct LaunchRuns {
  cl_mem src[kRunsPerLaunch] = {}, dst[kRunsPerLaunch] = {};
  cl_long4 src_rows{}, dst_rows{};
  cl_int4 starts{}, ends{};
  cl_long4 block_src{}, block_dst{};
};

// Checks run r of a launch and puts it into `l` (all but its end).
absl::Status PackRun(const RowRun& run, size_t r, const Buffer& moves, size_t row_bytes,
                     LaunchRuns& l) {
  const bool block = run.block_src >= 0;
  if (run.first < 0 || run.count < 0 || (block && run.block_dst < 0)) {
    return absl::InvalidArgumentError(absl::StrCat("CopyRowRuns: run first ", run.first, ", count ",
                                                   run.count, ", block_dst ", run.block_dst,
                                                   " (need >= 0)"));
  }
  if (block) {
    // Rows past either buffer's end write nothing (the kernel checks each row).
    EPSERVE_RETURN_IF_ERROR(NeedIntRange(run.block_src + run.count, "block_src"));
    EPSERVE_RETURN_IF_ERROR(NeedIntRange(run.block_dst + run.count, "block_dst"));
    l.block_src.s[r] = run.block_src;
    l.block_dst.s[r] = run.block_dst;
    l.starts.s[r] = -1;
  } else {
    EPSERVE_RETURN_IF_ERROR(
        NeedBytes(moves, (run.first + run.count) * 2 * sizeof(int32_t), "moves"));
    EPSERVE_RETURN_IF_ERROR(NeedIntRange(run.first, "first"));
    l.starts.s[r] = static_cast<cl_int>(run.first);
  }
  l.src[r] = run.src->mem();
  l.dst[r] = run.dst->mem();
  l.src_rows.s[r] = static_cast<cl_long>(run.src->bytes() / row_bytes);
  l.dst_rows.s[r] = static_cast<cl_long>(run.dst->bytes() / row_bytes);
  return absl::OkStatus();
}

// A launch of `kernel` whose work-groups each move whole rows, `width` work-items' values a
// row (copy_runs_grouped, return_rows): groups of up to kCopyRowLanes work-items, `groups` of
// them, or kCopyGroupsPerUnit per compute unit where `groups` is not > 0, at most one a row.
absl::Status LaunchRowGroups(Runtime& rt, cl_kernel kernel, int64_t rows, int64_t width,
                             int64_t groups) {
  const int64_t lanes = std::min<int64_t>(kCopyRowLanes, (width + 31) / 32 * 32);
  const int64_t units = std::max(1, rt.device_info().compute_units);
  const int64_t launched = std::min(rows, groups > 0 ? groups : units * kCopyGroupsPerUnit);
  const size_t global[1] = {static_cast<size_t>(launched * lanes)};
  const size_t local[1] = {static_cast<size_t>(lanes)};
  return detail::Launch(rt, kernel, 1, global, local);
}

}  // namespace

bool RowRunsTakeBlocks(const Runtime& rt, int64_t hidden, bool round_bf16, int64_t groups) {
  return groups >= 0 && (RowRunsGrouped(rt, hidden, groups) || !round_bf16);
}

absl::Status CopyRows(Runtime& rt, const Buffer& src, const Buffer& moves, int64_t first,
                      int64_t count, int64_t hidden, bool round_bf16, const Buffer& dst,
                      int64_t groups) {
  if (first < 0 || count < 0 || hidden < 1 || groups < -1) {
    return absl::InvalidArgumentError(absl::StrCat("CopyRows: first ", first, ", count ", count,
                                                   ", hidden ", hidden, ", groups ", groups,
                                                   " (need >= 0, >= 0, >= 1, >= -1)"));
  }
  if (count == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(count, "count"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(moves, (first + count) * 2 * sizeof(int32_t), "moves"));
  // Four values per work-item where rows allow it; on GPUs, whole rows per work-group.
  if (RowRunsGrouped(rt, hidden, groups)) {
    const RowRun run[1] = {{&src, &dst, first, count}};
    return CopyRowRuns(rt, run, moves, hidden, round_bf16, groups > 0 ? groups : 0);
  }
  const bool by4 = hidden % 4 == 0;
  EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel(by4 ? "copy_rows4" : "copy_rows"));
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t width = by4 ? hidden / 4 : hidden;
  EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, src, static_cast<cl_long>(src.bytes() / row_bytes), moves,
                                  cl_long{first}, static_cast<cl_int>(count), cl_long{width},
                                  cl_int{round_bf16 ? 1 : 0}, dst,
                                  static_cast<cl_long>(dst.bytes() / row_bytes)));
  const size_t global[2] = {static_cast<size_t>(width), static_cast<size_t>(count)};
  return LaunchBounded(rt, kernel, 2, global, detail::kCpuCombineGroup);
}

absl::Status CopyRowRuns(Runtime& rt, std::span<const RowRun> runs, const Buffer& moves,
                         int64_t hidden, bool round_bf16, int64_t groups) {
  if (groups < 0) {
    return absl::InvalidArgumentError(absl::StrCat("CopyRowRuns: groups ", groups, " (need >= 0)"));
  }
  if (!RowRunsGrouped(rt, hidden, groups)) {
    for (const RowRun& run : runs) {
      if (run.block_src < 0) {
        EPSERVE_RETURN_IF_ERROR(
            CopyRows(rt, *run.src, moves, run.first, run.count, hidden, round_bf16, *run.dst));
        continue;
      }
      if (round_bf16 || run.block_dst < 0 || run.count < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("CopyRowRuns: a block of ", run.count, " rows to row ", run.block_dst,
                         round_bf16 ? " rounded to BF16 needs the grouped form (RowRunsTakeBlocks)"
                                    : " (need >= 0)"));
      }
      EPSERVE_RETURN_IF_ERROR(CopyBlock(rt, run, hidden));
    }
    return absl::OkStatus();
  }
  const size_t row_bytes = static_cast<size_t>(hidden) * sizeof(float);
  const int64_t quarter = hidden / 4;
  for (size_t at = 0; at < runs.size(); at += kRunsPerLaunch) {
    const std::span<const RowRun> part =
        runs.subspan(at, std::min(kRunsPerLaunch, runs.size() - at));
    LaunchRuns l;
    int64_t total = 0;
    for (size_t r = 0; r < kRunsPerLaunch; ++r) {
      if (r < part.size()) {
        EPSERVE_RETURN_IF_ERROR(PackRun(part[r], r, moves, row_bytes, l));
        total += part[r].count;
      }
      EPSERVE_RETURN_IF_ERROR(NeedIntRange(total, "rows"));
      l.ends.s[r] = static_cast<cl_int>(total);
    }
    if (total == 0) continue;
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel, rt.Kernel("copy_runs_grouped"));
    static_assert(kRunsPerLaunch == 4, "copy_runs_grouped takes four runs");
    EPSERVE_RETURN_IF_ERROR(SetArgs(kernel, l.src[0], l.src[1], l.src[2], l.src[3], l.dst[0],
                                    l.dst[1], l.dst[2], l.dst[3], l.src_rows, l.dst_rows, l.starts,
                                    l.ends, l.block_src, l.block_dst, moves, cl_long{quarter},
                                    cl_int{round_bf16 ? 1 : 0}));
    EPSERVE_RETURN_IF_ERROR(LaunchRowGroups(rt, kernel, total, quarter, groups));
  }
  return absl::OkStatus();
}

absl::Status ReturnRows(Runtime& rt, const ReturnRowsArgs& a) {
  const size_t senders = a.pairs_to.size();
  const bool parts = a.row_parts != nullptr;
  if (senders == 0 || a.source_begin.size() != senders + 1 || a.tokens.size() != senders ||
      (parts && a.parts_to.size() != senders) || a.pair_rows == nullptr || a.tables == nullptr ||
      a.hidden < 1 || a.pairs < 0 || a.rows < 0 || (!parts && a.rows != 0) || a.groups < -1 ||
      a.me < 0 || a.me >= static_cast<int>(senders)) {
    return absl::InvalidArgumentError(absl::StrCat("ReturnRows: ", senders,
                                                   " senders (>= 1, one source_begin more, a token "
                                                   "count each), hidden ",
                                                   a.hidden, " (>= 1), pairs ", a.pairs, ", rows ",
                                                   a.rows, " (>= 0, 0 without parts), me ", a.me,
                                                   ", groups ", a.groups));
  }
  if (a.pairs + a.rows == 0) return absl::OkStatus();
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(2 * a.pairs + a.rows, "pairs and rows"));
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(a.source_begin[senders], "source_begin"));
  EPSERVE_RETURN_IF_ERROR(NeedBytes(*a.tables, (2 * a.pairs + a.rows) * sizeof(int32_t), "tables"));
  const size_t row_bytes = static_cast<size_t>(a.hidden) * sizeof(float);
  const cl_long pair_src_rows = static_cast<cl_long>(a.pair_rows->bytes() / row_bytes);
  const cl_long part_src_rows = parts ? static_cast<cl_long>(a.row_parts->bytes() / row_bytes) : 0;
  const int64_t width = a.hidden % 4 == 0 ? a.hidden / 4 : a.hidden;
  const bool grouped = a.groups > 0 || (a.groups == 0 && !rt.device_info().is_cpu);
  const size_t values[2] = {static_cast<size_t>(width), static_cast<size_t>(a.pairs + a.rows)};
  for (size_t first = 0; first < senders; first += kRunsPerLaunch) {
    const size_t last = std::min(senders, first + kRunsPerLaunch);  // this launch's senders
    cl_mem pd[kRunsPerLaunch] = {}, qd[kRunsPerLaunch] = {};
    cl_long4 pair_dst_rows{}, part_dst_rows{};
    cl_int4 begin{}, tokens{};
    for (size_t g = 0; g < kRunsPerLaunch; ++g) {
      const size_t s = first + g;
      const bool used = s < last;
      pd[g] = used ? a.pairs_to[s]->mem() : nullptr;
      qd[g] = used && parts ? a.parts_to[s]->mem() : nullptr;
      pair_dst_rows.s[g] = used ? static_cast<cl_long>(a.pairs_to[s]->bytes() / row_bytes) : 0;
      part_dst_rows.s[g] =
          used && parts ? static_cast<cl_long>(a.parts_to[s]->bytes() / row_bytes) : 0;
      begin.s[g] = static_cast<cl_int>(a.source_begin[std::min(s, last)]);
      tokens.s[g] = used ? static_cast<cl_int>(a.tokens[s]) : 0;
    }
    EPSERVE_ASSIGN_OR_RETURN(cl_kernel kernel,
                             rt.Kernel(grouped ? "return_rows" : "return_rows_values"));
    const cl_mem row_parts = parts ? a.row_parts->mem() : nullptr;
    EPSERVE_RETURN_IF_ERROR(SetArgs(
        kernel, *a.pair_rows, pair_src_rows, row_parts, part_src_rows, pd[0], pd[1], pd[2], pd[3],
        qd[0], qd[1], qd[2], qd[3], pair_dst_rows, part_dst_rows, begin,
        static_cast<cl_int>(a.source_begin[last]), tokens, static_cast<cl_int>(a.me), *a.tables,
        static_cast<cl_int>(a.pairs), static_cast<cl_int>(a.rows), static_cast<cl_long>(a.hidden)));
    EPSERVE_RETURN_IF_ERROR(grouped
                                ? LaunchRowGroups(rt, kernel, a.pairs + a.rows, width, a.groups)
                                : LaunchBounded(rt, kernel, 2, values, detail::kCpuCombineGroup));
  }
  return absl::OkStatus();
}

}  // namespace epserve::kernels
