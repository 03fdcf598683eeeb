// What the front-end serves and who computes it: facts of the model and the workers, fixed at
// start, set by no front-end flag. The front-end's components take it by const reference
// beside their options (FrontEndOptions' groups).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "worker/placement.h"

namespace epserve::server {

struct ServedModel {
  int64_t hidden_size = 0;  // H
  std::vector<int> layers;  // served MoE layer indices, ascending; the first is the default
  int num_workers = 1;
  int num_experts = 1;
  int top_k = 1;               // routed experts per token: the width of topk_ids, topk_weights
  std::string device = "cpu";  // the workers' OpenCL device (--device), reported in ModelConfig
  // Whether every worker reads and writes rows in clients' CUDA memory (CUDA shared memory).
  bool workers_read_cuda = false;
  // Whether every worker reads and writes rows in clients' system shared memory itself
  // (--workers-read-shm): rank 0 then copies no rows of such requests.
  bool workers_read_shm = false;
  // Per served layer, which workers hold which experts (--redundant-experts); empty: one copy
  // of each.
  std::vector<worker::ExpertPlacement> placements = {};
};

}  // namespace epserve::server
