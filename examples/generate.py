#!/usr/bin/env python3
"""A whole Hugging Face model generating with its MoE layers served by epserve.

For each family (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V2, DeepSeek-V3): builds a
small model of that family with transformers from its config with fresh random weights, saves
it as a checkpoint folder, starts epserve on that folder (`mpirun -np 1+W epserve`, CPU workers
unless --device=gpu), and then, in this process:

1. checks that the server serves this model (model name, hidden size, served layers, and one
   probe a layer: the server's routing and output against the model's own MoE block);
2. compares the logits of each prompt's forward pass with the model run whole (relative to the
   largest logit) and greedy generation of --new-tokens tokens from each prompt, one at a time
   and as one batch of 16, with `model.generate` run whole;
3. with --speed (the first family by default), times prefill and decode with the model whole
   and with each way of calling epserve: unary ModelInfer or one ModelStreamInfer stream for
   the whole run, rows inline or in system shared memory.

    examples/install-deps.sh                      # once: transformers and torch in a venv
    ~/.cache/epserve/examples-venv/bin/python examples/generate.py

Exits 0 when every family gave the same tokens and its logits agreed within the tolerance
(FP32; BF16 is compared and reported), 1 otherwise, 2 on a configuration error (named) before
anything was generated.
"""

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="all",
                   help="comma-separated families, or 'all' (qwen2_moe, qwen3_moe, mixtral, "
                        "olmoe, deepseek_v2, deepseek_v3)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers")
    p.add_argument("--hidden", type=int, default=256, help="hidden size")
    p.add_argument("--ffn", type=int, default=128, help="a routed expert's intermediate size")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the model's weights and epserve's --weight-dtype (bf16: BF16 rows too)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="gpu: the model on CUDA here and epserve's workers on GPUs")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prompts", type=int, default=3, help="prompts compared one at a time")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=None, help="weights and prompts (default: fresh)")
    p.add_argument("--speed", default=None,
                   help="families to time (comma-separated, 'all' or 'none'; default: the first)")
    p.add_argument("--speed-reps", type=int, default=3, help="timed runs of each figure (median)")
    p.add_argument("--build", default=os.path.join(ROOT, "build"), help="epserve's build folder")
    p.add_argument("--epserve", default=None,
                   help="the epserve executable (default: the build folder's server/epserve)")
    p.add_argument("--server", default=None,
                   help="host:port of a running epserve to use instead of starting one (then "
                        "--checkpoint names the folder the model is loaded from)")
    p.add_argument("--checkpoint", default=None,
                   help="load the model from this folder instead of building one (one family)")
    p.add_argument("--model-name", default="moe", help="the served model's name")
    p.add_argument("--server-arg", action="append", default=[],
                   help="one more epserve flag for the servers it starts (repeatable)")
    args = p.parse_args(argv)
    return args


def setup_imports(build):
    proto = os.path.join(build, "proto", "python")
    if not os.path.isdir(proto):
        sys.exit(f"error: no {proto}: build epserve first (deploy/build.sh) or pass --build")
    sys.path[:0] = [proto, os.path.join(ROOT, "client", "python"), os.path.dirname(__file__)]


def machine(device):
    import torch
    if device == "gpu":
        return torch.cuda.get_device_name(0)
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/cpuinfo") as f:
            flags = next((l for l in f if l.startswith("flags")), "").split()
        ext = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if x in flags]
        model += f" ({os.cpu_count()} threads; {' '.join(ext) or 'no AVX2'})"
    except OSError:
        pass
    return model


class Run:
    """One family: its model, its server, the client and the comparisons."""

    def __init__(self, args, family, seed, hf, torch, transformers, epserve_client, local):
        self.args, self.family, self.seed = args, family, seed
        self.hf, self.torch, self.client_mod, self.local = hf, torch, epserve_client, local
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.wire = "BF16" if args.dtype == "bf16" else "FP32"
        self.device = "cuda" if args.device == "gpu" else "cpu"
        # Relative to the largest value. FP32: sums in another order. BF16: the layer probe's
        # bound; the logits are held to twice the whole BF16 model's own distance from FP32.
        self.tolerance = 1e-4 if args.dtype == "fp32" else 5e-2
        self.tmp = tempfile.TemporaryDirectory(prefix=f"epserve-{family}-")
        if args.checkpoint:
            self.folder = args.checkpoint
            model = transformers.AutoModelForCausalLM.from_pretrained(self.folder,
                                                                      dtype=torch.float32)
        else:
            config = hf.tiny_config(family, layers=args.layers, hidden=args.hidden,
                                    ffn=args.ffn, experts=args.experts, top_k=args.top_k,
                                    vocab=args.vocab)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            hf.randomize(model, seed)
            self.folder = os.path.join(self.tmp.name, "checkpoint")
            model.to(self.dtype)
            model.save_pretrained(self.folder)
        self.model = model.to(self.device, self.dtype).eval()
        # BF16: the same BF16 weights computed in FP32 too, the exact answer both BF16 runs
        # are measured against.
        self.exact = (copy.deepcopy(self.model).float().eval() if args.dtype == "bf16"
                      else None)
        gen = self.model.generation_config
        gen.eos_token_id = None  # always --new-tokens tokens
        gen.pad_token_id = 0
        gen.do_sample = False
        self.server = None

    def start(self):
        args = self.args
        if args.server:
            address = args.server
        else:
            flags = [f"--weight-dtype={args.dtype}", "--max-batch-tokens=512",
                     *args.server_arg]
            t0 = time.perf_counter()
            binary = args.epserve or os.path.join(args.build, "server", "epserve")
            self.server = self.local.LocalServer(binary,
                                              self.folder, workers=args.workers,
                                              device=args.device, args=flags)
            print(f"  epserve ready in {time.perf_counter() - t0:.1f} s ({args.workers} "
                  f"{args.device.upper()} workers, {self.folder})", flush=True)
            address = self.server.address
        self.client = self.client_mod.Client(address, args.model_name)
        errors = self.hf.check_served(self.model, self.client, tolerance=self.tolerance,
                                      datatype=self.wire, seed=self.seed)
        worst = max(e for pair in errors.values() for e in pair)
        print(f"  served layers {sorted(errors)} match the model's MoE blocks on probe rows "
              f"(routing weights and output within {worst:.1e} relative)", flush=True)
        self.served = self.hf.serve_moe_blocks(self.model, self.hf.Unary(self.client, self.wire))

    def stop(self):
        if self.server is not None:
            self.server.stop()
        self.tmp.cleanup()

    def prompts(self, count, length, rng):
        ids = rng.integers(3, self.model.config.vocab_size, size=(count, length))
        return self.torch.from_numpy(ids).to(self.device)

    def generate(self, mode, ids, new_tokens, check_routing=False):
        self.hf.set_mode(self.served, mode, check_routing=check_routing)
        with self.torch.no_grad():
            out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                      do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        return out.sequences[:, ids.shape[1]:].cpu(), [l.float().cpu() for l in out.logits]

    def compare(self, rng):
        """Logits of the prompts' forward pass and greedy tokens, served against whole.
        FP32: every token must be the same and the logits within the tolerance; returns the
        count of sequences and prompts that are not. BF16 (two roundings of the same weights,
        which may route a token differently) is compared and reported; returns 0."""
        torch, hf = self.torch, self.hf
        strict = self.exact is None
        lengths = [5 + 6 * i for i in range(self.args.prompts)]
        cases = [self.prompts(1, n, rng) for n in lengths] + [self.prompts(16, 12, rng)]
        worst, worst_whole, bad, ties, differing = 0.0, 0.0, 0, 0, 0
        for ids in cases:
            for served in self.served:
                served.routing_ties = served.routing_flips = 0
            with torch.no_grad():
                hf.set_mode(self.served, "local")
                want = self.model(ids).logits.float().cpu().numpy()
                hf.set_mode(self.served, "epserve", check_routing=strict)
                got = self.model(ids).logits.float().cpu().numpy()
                exact = None if strict else self.exact(ids).logits.float().cpu().numpy()
            want_tok, want_logits = self.generate("local", ids, self.args.new_tokens)
            got_tok, _ = self.generate("epserve", ids, self.args.new_tokens, check_routing=strict)
            flips = sum(served.routing_flips for served in self.served)
            # FP32 only: a row whose experts are tied within 1e-5 (in FP64) may go either way;
            # what follows from it in this case is reported, not counted.
            routing_tie = strict and not flips and sum(s.routing_ties for s in self.served)
            if flips:
                print(f"  ROUTING: prompt of {ids.shape[1]} tokens x {ids.shape[0]}: the server "
                      f"chose other experts than the model's router for {flips} row(s), by more "
                      f"than a tie")
                bad += 1
            elif routing_tie:
                print(f"  routing near tie: prompt of {ids.shape[1]} tokens x {ids.shape[0]}: "
                      f"{routing_tie} row(s) whose experts tie within 1e-5 in FP64 went the other "
                      f"way; this case's differences are reported, not counted")
            if strict:
                err = hf.relative_error(got, want)
                if err > self.tolerance and not routing_tie:
                    print(f"  LOGITS: prompt of {ids.shape[1]} tokens x {ids.shape[0]}: "
                          f"{err:.2e} relative, above {self.tolerance:g}")
                    bad += 1
            else:  # both BF16 runs measured from the same BF16 weights computed in FP32
                err = hf.relative_error(got, exact)
                worst_whole = max(worst_whole, hf.relative_error(want, exact))
            worst = max(worst, err)
            for b in range(ids.shape[0]):
                diff = (want_tok[b] != got_tok[b]).nonzero()
                if len(diff) == 0:
                    continue
                differing += 1
                step = int(diff[0])
                row = want_logits[step][b]
                margin = float(row[want_tok[b, step]] - row[got_tok[b, step]])
                scale = float(row.abs().max())
                # FP32: a tie is the whole model's own top two closer than the logits' bound,
                # or a routing tie upstream.
                tie = strict and (routing_tie or margin <= 2 * self.tolerance * scale)
                ties += tie
                bad += strict and not tie
                label = "differs" if not strict else "near tie" if tie else "MISMATCH"
                print(f"  {label}: prompt of {ids.shape[1]} tokens (row {b}) first differs at "
                      f"generated token {step}: whole {int(want_tok[b, step])}, served "
                      f"{int(got_tok[b, step])}; the whole model's logits for them differ by "
                      f"{margin:.3g} of {scale:.3g}")
        sequences = sum(int(ids.shape[0]) for ids in cases)
        same = sequences - differing
        if strict:
            logits = f"prompt logits within {worst:.1e} relative (bound {self.tolerance:g})"
        else:
            logits = (f"prompt logits {worst:.1e} relative from the same BF16 weights computed in "
                      f"FP32, the whole BF16 model {worst_whole:.1e} (reported, not required)")
        print(f"  {same}/{sequences} sequences of {self.args.new_tokens} "
              f"greedy tokens identical to model.generate run whole ({len(cases) - 1} prompts "
              f"of {', '.join(map(str, lengths))} tokens, one batch of 16); {logits}", flush=True)
        return bad, ties, worst

    # ---- speed
    def timed(self, fn):
        times = []
        for _ in range(self.args.speed_reps):
            if self.device == "cuda":
                self.torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if self.device == "cuda":
                self.torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def layer_p50_us(self, rows):
        times = [t for s in self.served for (n, t) in zip(s.rows, s.times) if n == rows]
        return statistics.median(times) * 1e6 if times else float("nan")

    def speed_row(self, mode, rng):
        torch, hf, n = self.torch, self.hf, self.args.new_tokens
        hf.set_mode(self.served, mode)
        long_prompt = self.prompts(1, 512, rng)

        def prefill():
            with torch.no_grad():
                self.model(long_prompt, use_cache=False)

        row = {"prefill": 512 / self.timed(prefill)}
        for batch in (1, 16):
            ids = self.prompts(batch, 16, rng)

            def gen(tokens):
                with torch.no_grad():
                    self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                        max_new_tokens=tokens, min_new_tokens=tokens,
                                        do_sample=False)

            first = self.timed(lambda: gen(1))
            for s in self.served:
                s.times.clear()
                s.rows.clear()
            whole = self.timed(lambda: gen(n))
            tpot = (whole - first) / (n - 1)
            row[f"tpot{batch}"] = tpot * 1e3
            row[f"tps{batch}"] = batch / tpot
            row[f"moe{batch}"] = self.layer_p50_us(batch)
        return row

    def speed(self, rng):
        hf = self.hf
        rows = [("PyTorch, the model whole (MoE blocks local)", self.speed_row("local", rng))]
        H = self.model.config.hidden_size
        for make in (lambda: hf.Unary(self.client, self.wire),
                     lambda: hf.Unary(self.client, self.wire, shared_memory=True, max_tokens=512,
                                      hidden=H),
                     lambda: hf.Stream(self.client, self.wire),
                     lambda: hf.Stream(self.client, self.wire, shared_memory=True,
                                       max_tokens=512, hidden=H)):
            transport = make()
            try:
                hf.set_mode(self.served, "epserve", transport)
                rows.append((f"epserve, {transport.name}", self.speed_row("epserve", rng)))
            finally:
                transport.close()
        return rows


def print_speed(family, args, rows, where):
    print(f"\nSpeed, {family} ({args.layers} layers, hidden {args.hidden}, {args.experts} experts "
          f"top-{args.top_k}, {args.dtype.upper()}; {args.workers} {args.device.upper()} "
          f"workers; {where}); medians of {args.speed_reps} runs:\n")
    head = ("| MoE layers run by | prefill 512 tok/s | decode b1 tok/s | TPOT b1 ms "
            "| decode b16 tok/s | TPOT b16 ms | MoE call p50 b1 us | MoE call p50 b16 us |")
    print(head)
    print("|" + "---|" * 8)
    for name, r in rows:
        print(f"| {name} | {r['prefill']:.0f} | {r['tps1']:.1f} | {r['tpot1']:.2f} | "
              f"{r['tps16']:.1f} | {r['tpot16']:.2f} | {r['moe1']:.0f} | {r['moe16']:.0f} |")
    print(flush=True)


def main(argv=None):
    args = parse_args(argv)
    setup_imports(args.build)
    import numpy as np
    import torch
    import transformers
    import epserve_client
    import epserve_hf as hf
    import epserve_local

    families = list(hf.FAMILIES) if args.families == "all" else args.families.split(",")
    for f in families:
        if f not in hf.FAMILIES:
            print(f"error: unknown family {f!r}; epserve serves {', '.join(hf.FAMILIES)}")
            return 2
    if args.checkpoint and len(families) != 1:
        families = ["checkpoint"]
    if args.server and not args.checkpoint:
        print("error: --server needs --checkpoint (the folder that server serves)")
        return 2
    speed = {"none": [], "all": families, None: families[:1]}.get(
        args.speed, (args.speed or "").split(","))
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    where = machine(args.device)
    print(f"epserve + transformers {transformers.__version__}, torch {torch.__version__}; "
          f"seed {seed}; {where}", flush=True)
    failed = 0
    config_errors = []
    for family in families:
        print(f"\n{family}: {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
              f"top-{args.top_k}, {args.dtype.upper()}", flush=True)
        run = None
        try:
            run = Run(args, family, seed, hf, torch, transformers, epserve_client, epserve_local)
            run.start()
            rng = np.random.default_rng(seed)
            bad, ties, _ = run.compare(rng)
            failed += bad
            if family in speed:
                print_speed(family, args, run.speed(rng), where)
        except (hf.ConfigError, epserve_local.ServerError) as e:
            print(f"error: {family}: {e}", flush=True)
            config_errors.append(family)
        finally:
            if run is not None:
                run.stop()
    if config_errors:
        print(f"\nresult: configuration error(s) in {', '.join(config_errors)}")
        return 2
    if args.dtype == "bf16":
        print("\nresult: BF16 compared and reported above (FP32 weights give the exact check)")
        return 0
    print("\nresult: " + ("every family gave the whole model's tokens" if not failed else
                          f"{failed} sequence(s) or logits differ"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
