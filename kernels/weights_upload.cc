// Expert and router weights onto the device, in the layout the kernels read
// (kernels/detail/ffn_layout.h); the public functions are declared in moe_kernels.h.
#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "kernels/detail/cl_check.h"
#include "kernels/detail/ffn_layout.h"
#include "kernels/detail/launch.h"
#include "kernels/moe_kernels.h"

namespace epserve::kernels {
namespace {

using detail::NeedIntRange;
using model::TensorKind;

// Writes elements [offset, offset + count) of `dst`, an array of T, by `fill(host_ptr)`
// through a mapping, so no second host copy of the region is kept beyond what the driver needs.
template <typename T, typename FillFn>
absl::Status FillMapped(Runtime& rt, const Buffer& dst, int64_t offset, int64_t count,
                        FillFn&& fill) {
  cl_int err = CL_SUCCESS;
  void* host = nullptr;
  CL_CHECK(
      (host = clEnqueueMapBuffer(rt.queue(), dst.mem(), CL_TRUE, CL_MAP_WRITE_INVALIDATE_REGION,
                                 offset * sizeof(T), count * sizeof(T), 0, nullptr, nullptr, &err),
       err));
  absl::Status filled = fill(static_cast<T*>(host));
  CL_CHECK(clEnqueueUnmapMemObject(rt.queue(), dst.mem(), host, 0, nullptr, nullptr));
  return filled;
}

// The stored form of one weight value.
inline float ToElement(float v, float*) { return v; }
inline uint16_t ToElement(float v, uint16_t*) { return FloatToBf16(v); }

// What the experts are filled from: the source's tensors of these kinds, except the experts
// `reuse` (same layer, same layout) holds, which are copied from it on the device.
struct FfnKinds {
  TensorKind gate, up, down;
  const ExpertWeights* reuse = nullptr;
};

// Fills the weights of every expert of `w`, one host tensor at a time: for expert i it maps
// the expert's gate_up region (gu_elems values of T) and calls place_gate_up(dst, half, in)
// with the gate (half 0), then the up projection (half 1) in `in` ([F, H]); then it maps the
// down region (down_elems values) and calls place_down(dst, in) with down ([H, F]). The
// place functions write every value of the region (padding included) in their layout.
template <typename T, typename GateUpFn, typename DownFn>
absl::Status FillExperts(Runtime& rt, const model::WeightSource& source, int layer, FfnKinds kinds,
                         ExpertWeights& w, int64_t gu_elems, int64_t down_elems,
                         GateUpFn&& place_gate_up, DownFn&& place_down) {
  std::vector<float> staging(w.hidden * w.ffn);  // one [F, H] or [H, F] tensor
  for (int i = 0; i < w.num_experts; ++i) {
    const int expert = w.experts[i];
    const std::vector<int>* held = kinds.reuse != nullptr ? &kinds.reuse->experts : nullptr;
    const auto j = held != nullptr ? std::find(held->begin(), held->end(), expert)
                                   : std::vector<int>::const_iterator();
    if (held != nullptr && j != held->end()) {
      const size_t from = static_cast<size_t>(j - held->begin());
      const size_t gu = static_cast<size_t>(gu_elems) * sizeof(T);
      const size_t down = static_cast<size_t>(down_elems) * sizeof(T);
      CL_CHECK(clEnqueueCopyBuffer(rt.queue(), kinds.reuse->gate_up.mem(), w.gate_up.mem(),
                                   from * gu, i * gu, gu, 0, nullptr, nullptr));
      CL_CHECK(clEnqueueCopyBuffer(rt.queue(), kinds.reuse->down.mem(), w.down.mem(), from * down,
                                   i * down, down, 0, nullptr, nullptr));
      continue;
    }
    w.bytes_from_source += static_cast<size_t>(gu_elems + down_elems) * sizeof(T);
    EPSERVE_RETURN_IF_ERROR(FillMapped<T>(rt, w.gate_up, i * gu_elems, gu_elems, [&](T* dst) {
      for (int half = 0; half < 2; ++half) {
        EPSERVE_RETURN_IF_ERROR(
            source.Fill(layer, half == 0 ? kinds.gate : kinds.up, expert, staging.data()));
        place_gate_up(dst, half, staging.data());
      }
      return absl::OkStatus();
    }));
    EPSERVE_RETURN_IF_ERROR(FillMapped<T>(rt, w.down, i * down_elems, down_elems, [&](T* dst) {
      EPSERVE_RETURN_IF_ERROR(source.Fill(layer, kinds.down, expert, staging.data()));
      place_down(dst, staging.data());
      return absl::OkStatus();
    }));
  }
  return rt.Finish();
}

// Where column c of a panel row of pw columns is stored (kernels/detail/ffn_layout.h): in
// order for FP32; for BF16 each column of the first half next to the same column of the
// second half, so that one 32-bit word holds both and widens with a shift and a mask.
inline int64_t PanelSlot(float*, int64_t c, int64_t pw) { return c; }
inline int64_t PanelSlot(uint16_t*, int64_t c, int64_t pw) {
  return 2 * (c % (pw / 2)) + c / (pw / 2);
}

// The panel layout of kernels/detail/ffn_layout.h with elements of type T (float or BF16
// bits).
template <typename T>
absl::Status FillFfn(Runtime& rt, const model::WeightSource& source, int layer, FfnKinds kinds,
                     ExpertWeights& w) {
  const int64_t hidden = w.hidden;
  const int64_t ffn = w.ffn;
  const int64_t pw = w.blocking.panel_cols();
  const int64_t half_cols = pw / 2;
  const int64_t gu_panels = detail::GateUpPanels(ffn, pw);
  const int64_t down_panels = detail::DownPanels(hidden, pw);
  return FillExperts<T>(
      rt, source, layer, kinds, w, detail::GateUpFloatsPerExpert(hidden, ffn, pw),
      detail::DownFloatsPerExpert(hidden, ffn, pw),
      [&](T* dst, int half, const float* staging) {
        // dst[(j * H + k) * pw + slot(c)]: gate row f = j * half_cols + c for c < half_cols,
        // up row f for c >= half_cols.
        for (int64_t j = 0; j < gu_panels; ++j) {
          for (int64_t c = 0; c < half_cols; ++c) {
            const int64_t f = j * half_cols + c;
            T* out = dst + j * hidden * pw + PanelSlot(dst, half * half_cols + c, pw);
            if (f < ffn) {
              const float* in = staging + f * hidden;
              for (int64_t k = 0; k < hidden; ++k) out[k * pw] = ToElement(in[k], out);
            } else {
              for (int64_t k = 0; k < hidden; ++k) out[k * pw] = T{0};
            }
          }
        }
      },
      [&](T* dst, const float* staging) {
        // dst[(j * F + f) * pw + slot(c)] = down[j * pw + c][f].
        for (int64_t j = 0; j < down_panels; ++j) {
          for (int64_t c = 0; c < pw; ++c) {
            const int64_t row = j * pw + c;
            T* out = dst + j * ffn * pw + PanelSlot(dst, c, pw);
            if (row < hidden) {
              const float* in = staging + row * ffn;
              for (int64_t f = 0; f < ffn; ++f) out[f * pw] = ToElement(in[f], out);
            } else {
              for (int64_t f = 0; f < ffn; ++f) out[f * pw] = T{0};
            }
          }
        }
      });
}

// The tensor-core layout of kernels/detail/ffn_layout.h (BF16 [N, K] in tiles, zero padding).
absl::Status FillFfnMma(Runtime& rt, const model::WeightSource& source, int layer, FfnKinds kinds,
                        ExpertWeights& w) {
  const int64_t hidden = w.hidden;
  const int64_t ffn = w.ffn;
  const int64_t k_pad = detail::MmaKPad(hidden);
  const int64_t f_pad = detail::MmaFfnPad(ffn);
  const int64_t down_rows = detail::MmaDownRows(hidden);
  return FillExperts<uint16_t>(
      rt, source, layer, kinds, w, detail::MmaGateUpValuesPerExpert(hidden, ffn),
      detail::MmaDownValuesPerExpert(hidden, ffn),
      [&](uint16_t* dst, int half, const float* staging) {
        // Row (f / 8) * 16 + half * 8 + f % 8 holds gate (half 0) or up (half 1) row f.
        for (int64_t f = 0; f < f_pad; ++f) {
          const int64_t n = (f / 8) * 16 + half * 8 + f % 8;
          for (int64_t k0 = 0; k0 < k_pad; k0 += 8) {  // 8 values share a 16-byte chunk
            uint16_t* out = dst + detail::MmaTiledOffset(n, k0, k_pad);
            for (int64_t k = k0; k < k0 + 8; ++k) {
              out[k - k0] = f < ffn && k < hidden ? FloatToBf16(staging[f * hidden + k]) : 0;
            }
          }
        }
      },
      [&](uint16_t* dst, const float* staging) {
        for (int64_t c = 0; c < down_rows; ++c) {
          for (int64_t f0 = 0; f0 < f_pad; f0 += 8) {
            uint16_t* out = dst + detail::MmaTiledOffset(c, f0, f_pad);
            for (int64_t f = f0; f < f0 + 8; ++f) {
              out[f - f0] = c < hidden && f < ffn ? FloatToBf16(staging[c * ffn + f]) : 0;
            }
          }
        }
      });
}

// The pair-panel layout of kernels/detail/ffn_layout.h (BF16, K in pairs, zero padding).
absl::Status FillFfnDot(Runtime& rt, const model::WeightSource& source, int layer, FfnKinds kinds,
                        ExpertWeights& w) {
  const int64_t hidden = w.hidden;
  const int64_t ffn = w.ffn;
  const int64_t pw = detail::kDotPanelCols;
  const int64_t half_cols = pw / 2;
  const int64_t gu_panel_values = detail::DotKPairs(hidden) * 2 * pw;
  const int64_t down_panel_values = detail::DotKPairs(ffn) * 2 * pw;
  const int64_t gu_elems = detail::GateUpDotValuesPerExpert(hidden, ffn);
  const int64_t down_elems = detail::DownDotValuesPerExpert(hidden, ffn);
  return FillExperts<uint16_t>(
      rt, source, layer, kinds, w, gu_elems, down_elems,
      [&](uint16_t* dst, int half, const float* staging) {
        // Padding (columns past F, k = H) stays zero: the region is cleared before the gate.
        if (half == 0) std::fill(dst, dst + gu_elems, uint16_t{0});
        // Panel column c < half_cols: gate row f = j * half_cols + c; c >= half_cols: up row f.
        for (int64_t f = 0; f < ffn; ++f) {
          uint16_t* panel = dst + (f / half_cols) * gu_panel_values;
          const int64_t c = half * half_cols + f % half_cols;
          const float* in = staging + f * hidden;
          for (int64_t k = 0; k < hidden; ++k) {
            panel[detail::DotPanelOffset(c, k)] = FloatToBf16(in[k]);
          }
        }
      },
      [&](uint16_t* dst, const float* staging) {
        std::fill(dst, dst + down_elems, uint16_t{0});  // padding: rows past H, f = F
        for (int64_t row = 0; row < hidden; ++row) {
          uint16_t* panel = dst + (row / pw) * down_panel_values;
          const float* in = staging + row * ffn;
          for (int64_t f = 0; f < ffn; ++f) {
            panel[detail::DotPanelOffset(row % pw, f)] = FloatToBf16(in[f]);
          }
        }
      });
}

// Whether experts of this shape and dtype take the tensor-core kernels (and so no FFN plan).
bool OnTensorCores(const Runtime& rt, int64_t hidden, int64_t ffn, common::ElementType dtype) {
  return dtype == common::ElementType::kBf16 && rt.tensor_cores() &&
         detail::MmaFitsCallerBuffers(hidden, ffn);
}

absl::StatusOr<ExpertWeights> UploadFfn(Runtime& rt, const model::WeightSource& source, int layer,
                                        FfnKinds kinds, std::span<const int> experts, int64_t ffn,
                                        common::ElementType dtype,
                                        const ExpertWeights* reuse = nullptr) {
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(dtype, "the weights' element type"));
  const model::MoeLayerConfig& cfg = source.config().layer;
  const int64_t hidden = cfg.hidden_size;
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(hidden, "hidden_size"));
  EPSERVE_RETURN_IF_ERROR(NeedIntRange(ffn, "ffn size"));
  ExpertWeights w;
  w.experts.assign(experts.begin(), experts.end());
  w.num_experts = static_cast<int>(experts.size());
  const int64_t count = w.num_experts;
  w.hidden = hidden;
  w.ffn = ffn;
  w.dtype = dtype;
  // The layout, hence the element counts, follows from the dtype and the device.
  w.tensor_cores = OnTensorCores(rt, hidden, ffn, dtype);
  if (!w.tensor_cores) {
    // The forms per row class: FMA blockings, or (BF16 weights where they run) pair-panel forms.
    EPSERVE_ASSIGN_OR_RETURN(w.plan, rt.ChooseFfnPlan(hidden, ffn, dtype));
    w.blocking = w.plan.layout();
    w.bf16_dot = w.blocking.dot;
  }
  const int64_t pw = w.blocking.panel_cols();
  const int64_t gate_up_values = w.tensor_cores ? detail::MmaGateUpValuesPerExpert(hidden, ffn)
                                 : w.bf16_dot   ? detail::GateUpDotValuesPerExpert(hidden, ffn)
                                                : detail::GateUpFloatsPerExpert(hidden, ffn, pw);
  const int64_t down_values = w.tensor_cores ? detail::MmaDownValuesPerExpert(hidden, ffn)
                              : w.bf16_dot   ? detail::DownDotValuesPerExpert(hidden, ffn)
                                             : detail::DownFloatsPerExpert(hidden, ffn, pw);
  const size_t elem = common::ElementBytes(dtype);
  EPSERVE_ASSIGN_OR_RETURN(Buffer gate_up, rt.Allocate(gate_up_values * count * elem));
  EPSERVE_ASSIGN_OR_RETURN(Buffer down, rt.Allocate(down_values * count * elem));
  w.gate_up = std::move(gate_up);
  w.down = std::move(down);
  // Experts another upload of the same layer holds in the same layout are copied from it.
  if (reuse != nullptr && reuse->dtype == w.dtype && reuse->tensor_cores == w.tensor_cores &&
      reuse->bf16_dot == w.bf16_dot && SameFfnLayout(reuse->blocking, w.blocking) &&
      reuse->hidden == w.hidden && reuse->ffn == w.ffn) {
    kinds.reuse = reuse;
  }
  if (w.tensor_cores) {
    EPSERVE_RETURN_IF_ERROR(FillFfnMma(rt, source, layer, kinds, w));
  } else if (w.bf16_dot) {
    EPSERVE_RETURN_IF_ERROR(FillFfnDot(rt, source, layer, kinds, w));
  } else if (dtype == common::ElementType::kBf16) {
    EPSERVE_RETURN_IF_ERROR(FillFfn<uint16_t>(rt, source, layer, kinds, w));
  } else {
    EPSERVE_RETURN_IF_ERROR(FillFfn<float>(rt, source, layer, kinds, w));
  }
  return w;
}

}  // namespace

absl::StatusOr<RouterWeights> UploadRouter(Runtime& rt, const model::WeightSource& source,
                                           int layer) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  EPSERVE_RETURN_IF_ERROR(cfg.Validate());
  if (cfg.num_experts > detail::kRouterMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat("num_experts=", cfg.num_experts,
                                                   " exceeds the router kernel's maximum of ",
                                                   detail::kRouterMaxExperts));
  }
  RouterWeights w;
  w.cfg = cfg;
  const model::TensorShape shape = model::ShapeOf(cfg, TensorKind::kRouter);
  std::vector<float> staging(shape.numel());
  EPSERVE_RETURN_IF_ERROR(source.Fill(layer, TensorKind::kRouter, 0, staging.data()));
  EPSERVE_ASSIGN_OR_RETURN(Buffer router,
                           rt.AllocateCopy(staging.data(), staging.size() * sizeof(float)));
  w.router = std::move(router);
  const model::TensorShape bias_shape = model::ShapeOf(cfg, TensorKind::kRouterBias);
  if (bias_shape.numel() > 0) {
    staging.assign(bias_shape.numel(), 0.0f);
    EPSERVE_RETURN_IF_ERROR(source.Fill(layer, TensorKind::kRouterBias, 0, staging.data()));
    EPSERVE_ASSIGN_OR_RETURN(Buffer bias,
                             rt.AllocateCopy(staging.data(), staging.size() * sizeof(float)));
    w.bias = std::move(bias);
  }
  return w;
}

const char* FfnKernelsName(const Runtime& rt, const ExpertWeights& w) {
  return w.tensor_cores && rt.wgmma()  ? "tensor cores, wgmma"
         : w.tensor_cores              ? "tensor cores"
         : w.bf16_dot && rt.bf16_amx() ? "bf16 amx tiles"
         : w.bf16_dot                  ? "bf16 dot products"
                                       : "fp32 fma";
}

absl::StatusOr<ExpertWeights> UploadExperts(Runtime& rt, const model::WeightSource& source,
                                            int layer, std::span<const int> experts,
                                            common::ElementType dtype, const ExpertWeights* reuse) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  EPSERVE_RETURN_IF_ERROR(cfg.Validate());
  for (int e : experts) {
    if (e < 0 || e >= cfg.num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert ", e, " not within [0, num_experts=", cfg.num_experts, ")"));
    }
  }
  return UploadFfn(rt, source, layer,
                   {TensorKind::kExpertGate, TensorKind::kExpertUp, TensorKind::kExpertDown},
                   experts, cfg.expert_ffn_size, dtype, reuse);
}

absl::StatusOr<ExpertWeights> UploadExperts(Runtime& rt, const model::WeightSource& source,
                                            int layer, int first_expert, int num_experts,
                                            common::ElementType dtype) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  if (first_expert < 0 || num_experts < 0 || first_expert + num_experts > cfg.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("experts [", first_expert, ", ",
                                                   first_expert + num_experts, ") not within [0, ",
                                                   cfg.num_experts, ")"));
  }
  std::vector<int> ids(static_cast<size_t>(num_experts));
  for (int i = 0; i < num_experts; ++i) ids[i] = first_expert + i;
  return UploadExperts(rt, source, layer, ids, dtype);
}

absl::Status ChooseExpertFfnPlans(Runtime& rt, int64_t hidden, std::span<const int64_t> ffn_sizes,
                                  common::ElementType dtype) {
  EPSERVE_RETURN_IF_ERROR(CheckKernelType(dtype, "the weights' element type"));
  std::vector<FfnShape> shapes;
  for (int64_t ffn : ffn_sizes) {
    if (hidden > 0 && ffn > 0 && !OnTensorCores(rt, hidden, ffn, dtype)) {
      shapes.push_back({hidden, ffn, dtype});
    }
  }
  return rt.ChooseFfnPlans(shapes);
}

absl::StatusOr<ExpertWeights> UploadSharedExpert(Runtime& rt, const model::WeightSource& source,
                                                 int layer, common::ElementType dtype) {
  const model::MoeLayerConfig& cfg = source.config().layer;
  EPSERVE_RETURN_IF_ERROR(cfg.Validate());
  if (cfg.shared_ffn_size <= 0) {
    return absl::FailedPreconditionError("the layer has no shared expert (shared_ffn_size == 0)");
  }
  EPSERVE_ASSIGN_OR_RETURN(
      ExpertWeights w,
      UploadFfn(rt, source, layer,
                {TensorKind::kSharedGate, TensorKind::kSharedUp, TensorKind::kSharedDown},
                std::vector<int>{0}, cfg.shared_ffn_size, dtype));
  if (cfg.shared_expert_gate) {
    std::vector<float> gate(cfg.hidden_size);
    EPSERVE_RETURN_IF_ERROR(source.Fill(layer, TensorKind::kSharedExpertGate, 0, gate.data()));
    EPSERVE_ASSIGN_OR_RETURN(Buffer buffer,
                             rt.AllocateCopy(gate.data(), gate.size() * sizeof(float)));
    w.gate = std::move(buffer);
  }
  return w;
}

}  // namespace epserve::kernels
