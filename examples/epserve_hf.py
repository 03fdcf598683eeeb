"""A Hugging Face transformers model whose MoE blocks are served by epserve.

The attention tier of a disaggregated deployment in a few pieces: the model's embeddings,
attention, norms, dense MLPs and head run here in PyTorch, and the forward of each sparse MoE
block becomes a call to epserve for that decoder layer (request parameter `layer`), through
client/python/epserve_client.py.

    model = AutoModelForCausalLM.from_pretrained(folder)      # the folder epserve serves
    client = epserve_client.Client(address)
    check_served(model, client)                                # shapes, layers, one probe a layer
    blocks = serve_moe_blocks(model, Unary(client, "FP32"))    # now every MoE layer is served
    model.generate(...)
    set_mode(blocks, "local")                                  # back to the model's own blocks

Also here: small configurations of each family epserve loads (tiny_config) and a seeded
initialisation that keeps routing decisive (randomize). client/python/epserve_local.py starts
the `mpirun -np 1+W epserve` job on a checkpoint folder for the example and its test.
"""

import math
import time

import grpc
import numpy as np
import torch

# family (config.json "model_type") -> transformers config class. Every family epserve's
# checkpoint loader knows (model/checkpoint.h).
FAMILIES = {
    "qwen2_moe": "Qwen2MoeConfig",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "olmoe": "OlmoeConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
}


class ConfigError(Exception):
    """The model and the server (or the model and epserve's semantics) do not line up; the
    message names what differs. Raised before anything is generated."""


def tiny_config(family, *, layers=2, hidden=128, ffn=64, experts=8, top_k=2, vocab=512,
                heads=4):
    """A small configuration of `family` with the shapes given: `ffn` is a routed expert's
    intermediate size; the shared expert (where the family has one) is twice that. DeepSeek's
    first layer is dense (first_k_dense_replace=1), as in the real models; V2 routes by the
    softmax's top-k among the best groups (group_limited_greedy) and scales the weights, V3 by
    sigmoid scores with the correction bias, grouped top-k, renormalised and scaled."""
    import transformers

    if family not in FAMILIES:
        raise ConfigError(f"unknown family {family!r}; epserve serves {', '.join(FAMILIES)}")
    cls = getattr(transformers, FAMILIES[family], None)
    if cls is None:
        raise ConfigError(f"transformers {transformers.__version__} has no {FAMILIES[family]}")
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=4096,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen2_moe":
        return cls(**common, num_key_value_heads=heads // 2, intermediate_size=2 * ffn,
                   moe_intermediate_size=ffn, shared_expert_intermediate_size=2 * ffn,
                   num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if family == "qwen3_moe":
        return cls(**common, num_key_value_heads=heads // 2, head_dim=hidden // heads,
                   intermediate_size=2 * ffn, moe_intermediate_size=ffn, num_experts=experts,
                   num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[])
    if family == "mixtral":
        return cls(**common, num_key_value_heads=heads // 2, intermediate_size=ffn,
                   num_local_experts=experts, num_experts_per_tok=top_k)
    if family == "olmoe":
        return cls(**common, num_key_value_heads=heads, intermediate_size=ffn,
                   num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=False)
    groups = 4 if experts % 4 == 0 else 1
    mla = dict(num_key_value_heads=heads, kv_lora_rank=hidden // 4, qk_rope_head_dim=16,
               qk_nope_head_dim=16, v_head_dim=hidden // heads, first_k_dense_replace=1,
               intermediate_size=4 * ffn, moe_intermediate_size=ffn, n_routed_experts=experts,
               num_experts_per_tok=top_k, n_shared_experts=2, n_group=groups,
               topk_group=max(1, groups // 2))
    if family == "deepseek_v2":
        # DeepSeek-V2's gate: the softmax's top-k among the best groups, scaled.
        return cls(**common, **mla, q_lora_rank=None, topk_method="group_limited_greedy",
                   norm_topk_prob=False, routed_scaling_factor=2.0)
    return cls(**common, **mla, q_lora_rank=hidden // 2, norm_topk_prob=True,
               routed_scaling_factor=2.5)


def randomize(model, seed):
    """Fresh weights from `seed`: every matrix N(0, 1/fan_in) (so activations keep their scale
    and routing and the next token are decided by clear margins, not near-ties), norms 1 plus
    a little noise, biases small, DeepSeek-V3's expert-score correction bias random."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[-1]
                v = torch.randn(p.shape, generator=g) / math.sqrt(fan_in)
                if "embed_tokens" in name:
                    v = torch.randn(p.shape, generator=g)
            elif name.endswith("norm.weight") or "layernorm" in name:
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            else:
                v = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(v.to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_((0.05 * torch.randn(b.shape, generator=g)).to(b.dtype))


def moe_blocks(model):
    """{decoder layer index: its sparse MoE block} (dense layers are left out)."""
    found = {}
    for i, layer in enumerate(model.model.layers):
        mlp = layer.mlp if hasattr(layer, "mlp") else getattr(layer, "block_sparse_moe", None)
        if isinstance(mlp, ServedMoe):
            mlp = mlp.local
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            found[i] = mlp
    return found


class Unary:
    """Each MoE call is one ModelInfer; `shared_memory` sends the rows through a system
    shared-memory region (room for `max_tokens` rows) instead of the message."""

    def __init__(self, client, datatype, *, shared_memory=False, max_tokens=4096, hidden=None):
        self.client = client
        self.datatype = datatype
        self.region = (client.shared_memory_rows(max_tokens, hidden, datatype)
                       if shared_memory else None)
        self.name = "unary, " + ("shared memory" if shared_memory else "inline")

    def __call__(self, x, layer, as_stored=False):
        return self.client.infer(x, datatype=self.datatype, layer=layer,
                                 shared_memory=self.region, as_stored=as_stored)

    def close(self):
        if self.region is not None:
            self.region.close()


class Stream(Unary):
    """Every MoE call of the run goes over one ModelStreamInfer stream, one request at a time
    (each layer's input is the last layer's output)."""

    def __init__(self, client, datatype, **kwargs):
        super().__init__(client, datatype, **kwargs)
        self.stream = client.open_stream()
        self.name = self.name.replace("unary", "stream")

    def __call__(self, x, layer, as_stored=False):
        return self.stream.infer(x, datatype=self.datatype, layer=layer,
                                 shared_memory=self.region, as_stored=as_stored)

    def close(self):
        self.stream.close()
        super().close()


class ServedMoe(torch.nn.Module):
    """Stands in for one sparse MoE block: mode "epserve" sends the block's input rows to
    epserve for `layer` through `transport` and returns the answer in the input's dtype and
    device; mode "local" runs the model's own block. Either way each call appends its rows to
    `rows` and its time to `times` (seconds).

    With `check_routing` (FP32, a Unary transport), each call also asks for the experts the
    server chose and compares them with the model's router on the same rows: a row whose
    choice differs counts in `routing_ties` where the choice is a tie within `tie` of the top
    score when computed in FP64 (two FP32 sums in another order may then choose either way),
    else in `routing_flips` (a real difference)."""

    def __init__(self, local, layer, transport):
        super().__init__()
        self.local = local
        self.layer = layer
        self.transport = transport
        self.mode = "epserve"
        self.rows = []
        self.times = []
        self.check_routing = False
        self.tie = 1e-5
        self.routing_ties = 0
        self.routing_flips = 0

    def _check(self, rows, served_ids):
        with torch.no_grad():
            _, _, ids = self.local.gate(rows)
        ids = np.sort(ids.cpu().numpy(), axis=1)
        differ = np.nonzero((ids != np.sort(served_ids, axis=1)).any(axis=1))[0]
        if len(differ):
            margins = routing_margins(self.local.gate, rows[torch.from_numpy(differ)])
            ties = int((margins <= self.tie).sum())
            self.routing_ties += ties
            self.routing_flips += len(differ) - ties

    def forward(self, hidden_states):
        t0 = time.perf_counter()
        if self.mode == "local":
            out = self.local(hidden_states)
            if hidden_states.is_cuda:
                torch.cuda.synchronize()
        else:
            shape = hidden_states.shape
            rows = hidden_states.reshape(-1, shape[-1])
            if rows.dtype == torch.bfloat16 and self.transport.datatype == "BF16":
                # BF16 bits travel as they are, both ways: no conversion through FP32.
                bits = rows.view(torch.int16).cpu().numpy()
                y = self.transport(bits, self.layer, as_stored=True).view(np.int16)
                out = torch.from_numpy(y.copy()).view(torch.bfloat16)
            elif self.check_routing:
                x = rows.float().cpu().numpy()
                y, ids, _ = self.transport.client.infer_routing(
                    x, datatype=self.transport.datatype, layer=self.layer)
                self._check(rows, ids)
                out = torch.from_numpy(y.copy()).to(hidden_states.dtype)
            else:
                y = self.transport(rows.float().cpu().numpy(), self.layer)
                out = torch.from_numpy(y.copy()).to(hidden_states.dtype)
            out = out.to(hidden_states.device).reshape(shape)
        self.times.append(time.perf_counter() - t0)
        self.rows.append(hidden_states.numel() // hidden_states.shape[-1])
        return out


def routing_margins(gate, rows):
    """Per row, how decisively the router `gate` (a transformers MoE gate) chooses, computed in
    FP64: the gap between the last chosen and the first unchosen score (and, for grouped
    routing, between the last chosen and first unchosen group), over the largest score."""
    x = rows.double()
    logits = x @ gate.weight.double().T
    n_group = getattr(gate, "num_group", None) or getattr(gate, "n_group", 1) or 1
    topk_group = getattr(gate, "topk_group", n_group) or n_group
    bias = getattr(gate, "e_score_correction_bias", None)
    if bias is not None:  # DeepSeek-V3: sigmoid scores plus the bias, groups by their top two
        choose = logits.sigmoid() + bias.double()
        groups = choose.view(len(x), n_group, -1).topk(2, dim=-1).values.sum(-1)
    else:
        choose = logits.softmax(-1)
        groups = choose.view(len(x), n_group, -1).max(-1).values
        if getattr(gate, "topk_method", "group_limited_greedy") != "group_limited_greedy":
            topk_group = n_group
    scale = choose.abs().max(-1).values
    margin = torch.full((len(x),), float("inf"), dtype=torch.float64, device=x.device)
    if topk_group < n_group:
        g = groups.sort(-1, descending=True).values
        margin = g[:, topk_group - 1] - g[:, topk_group]
        keep = groups.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask.repeat_interleave(choose.shape[1] // n_group, dim=1)
        choose = choose.masked_fill(~mask, float("-inf"))
    top = choose.topk(gate.top_k + 1, dim=-1).values
    margin = torch.minimum(margin, top[:, -2] - top[:, -1])
    return (margin / scale).detach().cpu().numpy()


def serve_moe_blocks(model, transport):
    """Replaces every sparse MoE block of `model` by a ServedMoe on `transport`; returns them."""
    served = []
    for i, block in moe_blocks(model).items():
        layer = model.model.layers[i]
        attr = "mlp" if hasattr(layer, "mlp") else "block_sparse_moe"
        wrapper = ServedMoe(block, i, transport)
        setattr(layer, attr, wrapper)
        served.append(wrapper)
    return served


def set_mode(served, mode, transport=None, check_routing=False):
    for s in served:
        s.mode = mode
        if transport is not None:
            s.transport = transport
        s.check_routing = check_routing
        s.rows.clear()
        s.times.clear()


def relative_error(got, want):
    """max |got - want| / max |want|, over float64 copies."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _router_settings(model):
    c = model.config
    keys = ("norm_topk_prob", "routed_scaling_factor", "topk_method", "n_group", "topk_group",
            "scoring_func")
    return ", ".join(f"{k}={getattr(c, k)}" for k in keys if hasattr(c, k))


def check_served(model, client, *, tolerance, probe_tokens=16, datatype="FP32", seed=0):
    """Raises ConfigError unless the server behind `client` serves this model's MoE layers:
    the model name exists, the hidden size and the served layers match the model's, and for
    every MoE layer the server's routing (top-k ids and weights) and output on probe rows
    agree with the model's own block within `tolerance` (relative to the largest value).
    Returns {layer: (routing weights error, output error)}."""
    try:
        cfg = client.model_config()
    except grpc.RpcError as e:  # NOT_FOUND names the model the server serves
        raise ConfigError(f"model {client.model!r}: {e.code().name}: {e.details()}") from None
    hidden = model.config.hidden_size
    served_hidden = cfg.input[0].dims[-1]
    if served_hidden != hidden:
        raise ConfigError(f"hidden size: the server's model {cfg.name!r} takes rows of "
                          f"{served_hidden}, this model's are {hidden}: another checkpoint")
    served = [int(v) for v in cfg.parameters["served_layers"].string_value.split(",") if v]
    blocks = moe_blocks(model)
    layers = model.config.num_hidden_layers
    beyond = [l for l in served if l >= layers]
    if beyond:
        raise ConfigError(f"layer count: the server serves layer(s) {beyond} but this model has "
                          f"{layers} decoder layers: another checkpoint")
    dense = [l for l in served if l not in blocks]
    if dense:
        raise ConfigError(f"the server serves layer(s) {dense} as MoE layers, which are dense in "
                          f"this model: another checkpoint")
    missing = [l for l in blocks if l not in served]
    if missing:
        raise ConfigError(f"layer(s) {missing} of this model are MoE layers the server does not "
                          f"serve (it serves {served}); start it with --layers=all")
    rng = np.random.default_rng(seed)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    errors = {}
    for layer, block in blocks.items():
        x = rng.standard_normal((probe_tokens, hidden)).astype(np.float32)
        xt = torch.from_numpy(x).to(device, dtype)
        if datatype == "BF16":  # what the wire carries
            x = xt.float().cpu().numpy()
        with torch.no_grad():
            _, want_w, want_ids = block.gate(xt)
            want_y = block(xt.unsqueeze(0))[0].float().cpu().numpy()
        want_ids = want_ids.cpu().numpy()
        want_w = want_w.float().cpu().numpy()
        got_y, got_ids, got_w = client.infer_routing(x, datatype=datatype, layer=layer)
        for r in range(probe_tokens):
            if sorted(got_ids[r]) != sorted(want_ids[r]):
                raise ConfigError(
                    f"layer {layer}: routing differs: for probe row {r} the server chose experts "
                    f"{sorted(got_ids[r].tolist())}, the model's router "
                    f"{sorted(want_ids[r].tolist())} ({model.config.model_type}: "
                    f"{_router_settings(model)})")
        order_got = np.argsort(got_ids, axis=1)
        order_want = np.argsort(want_ids, axis=1)
        w_err = relative_error(np.take_along_axis(got_w, order_got, 1),
                               np.take_along_axis(want_w, order_want, 1))
        y_err = relative_error(got_y, want_y)
        if w_err > tolerance:
            raise ConfigError(
                f"layer {layer}: routing weights differ by {w_err:.2e} relative (same experts): "
                f"the server weighs e.g. {np.sort(got_w[0]).tolist()}, the model "
                f"{np.sort(want_w[0]).tolist()} ({model.config.model_type}: "
                f"{_router_settings(model)})")
        if y_err > tolerance:
            raise ConfigError(
                f"layer {layer}: the server's output differs from the model's MoE block by "
                f"{y_err:.2e} relative with the same routing: the experts or the shared expert "
                f"differ (another checkpoint, or weights the server rounds)")
        errors[layer] = (w_err, y_err)
    return errors
