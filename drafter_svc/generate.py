"""Generate with the whole engine in one process (no network).

    python -m drafter_svc.generate --target DIR --draft DIR --prompt "def f(" --tree-budget 15

`--ar` is plain target autoregressive decoding (the baseline), `--chain` vanilla DFlash,
`--tree-budget B` DDTree with B drafted nodes per round. Prints the text and the stats,
or one JSON object with `--json`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.checkpoint import load_tokenizer
from common.cli import FlagParser, add_penalty_flags, fail, number_list, penalty_options, token_biases
from common.config import CheckpointError, load_draft_config
from common.devices import parse_device
from common.feature_projection import FeatureProjection
from common.protocol import SamplingParams, StatusError
from drafter_svc.drafter import DFlashProposer, DraftMode
from drafter_svc.link import LocalLink
from drafter_svc.scheduler import DraftScheduler
from drafter_svc.session import GenerationConfig, GenerationResult
from ddtree_kernels import batch_invariant
from verifier_svc.target_model import TargetModel
from verifier_svc.target_runner import TargetRunner
from verifier_svc.tree_verifier import TreeVerifier, VerifierLimits


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


@dataclass
class LocalEngine:
    """Target verifier + DFlash proposer + tokenizer, all in this process, batched by the
    same `DraftScheduler` as the drafter service, over an in-process link."""
    verifier: TreeVerifier
    proposer: DFlashProposer | None
    tokenizer: object
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, target_dir: str, draft_dir: str | None, device: str = "cpu", dtype: torch.dtype | None = None,
             limits: VerifierLimits = VerifierLimits(), cuda_graphs: bool = True,
             sampling: str = "keyed", projected: bool = False) -> "LocalEngine":
        """`cuda_graphs` (on CUDA): replay captured graphs for the draft step and the verify step;
        `sampling`: "keyed" (position-keyed) or "sample" (the coin walk), see `TargetRunner`;
        `projected`: the target applies the draft's fc + hidden_norm to its features and the draft
        takes context rows, as the verifier service does given `--draft` (default: the draft does)."""
        dtype = dtype or default_dtype(device)
        layer_ids = load_draft_config(draft_dir).target_layer_ids if draft_dir else ()
        proposer = None
        if draft_dir:
            proposer = DFlashProposer.from_pretrained(draft_dir, target_dir, device, dtype, limits.max_seq_len,
                                                      limits.max_sessions, cuda_graphs,
                                                      projected_features=projected)
        model = TargetModel.from_pretrained(target_dir, layer_ids, device=device, dtype=dtype)
        if projected and draft_dir:  # before the runner captures its graphs
            model.feature_projection = FeatureProjection.from_draft(draft_dir, device, dtype)
        runner = TargetRunner(model, limits.max_sessions, limits.max_seq_len, limits.max_tree_nodes,
                              cuda_graphs=cuda_graphs, sampling=sampling)
        return cls(TreeVerifier(runner, limits), proposer, load_tokenizer(target_dir), model.cfg.eos_token_ids)

    def generate_many(self, requests: Sequence[tuple[list[int], GenerationConfig]], pipelined: bool = False,
                      prefill_chunk: int = 0, prefill_ahead: int = 1) -> list[GenerationResult | StatusError]:
        """Run the requests together, batched as the service batches them; one result (or error) each.
        `pipelined`: group the sessions as the pipelined service does (in-process, nothing overlaps);
        `prefill_chunk`: prompt tokens per step, as the service's --prefill-chunk (0: no limit);
        `prefill_ahead`: as the service's --prefill-ahead."""
        link = LocalLink(self.verifier)
        scheduler = DraftScheduler(link, self.proposer, max_sessions=self.verifier.limits.max_sessions,
                                   feature_layer_ids=self.verifier.feature_layer_ids,
                                   eos_token_ids=self.eos_token_ids, queue_timeout_s=3600.0, pipelined=pipelined,
                                   prefill_chunk=prefill_chunk, prefill_ahead=prefill_ahead)
        ends: list[dict] = []
        for prompt_ids, config in requests:
            ends.append({})
            scheduler.submit(prompt_ids, config, functools.partial(_keep_end, ends[-1]))
        try:
            scheduler.run_until_idle()
        except BaseException:  # a bug: the verifier frees this run's sessions, and the next run starts clean
            with contextlib.suppress(Exception):
                link.close()
            raise
        return [end["outcome"] for end in ends]

    def generate(self, prompt_ids: list[int], config: GenerationConfig) -> GenerationResult:
        """One request; raises its StatusError if it fails."""
        outcome = self.generate_many([(prompt_ids, config)])[0]
        if isinstance(outcome, StatusError):
            raise outcome
        return outcome


def _keep_end(end: dict, item) -> None:
    if isinstance(item, (GenerationResult, StatusError)):
        end["outcome"] = item


def result_json(result: GenerationResult, text: str) -> dict:
    return {
        "tokens": result.tokens,
        "text": text,
        "finish_reason": result.finish_reason,
        "acceptance_lengths": result.acceptance_lengths,
        "rounds": result.rounds,
        "mean_acceptance": result.mean_acceptance,
        "tokens_per_s": result.tokens_per_s,
        "elapsed_s": result.elapsed_s,
        "time_to_first_token_s": result.time_to_first_token_s,
    }


def build_parser() -> FlagParser:
    p = FlagParser(prog="python -m drafter_svc.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target checkpoint folder (config.json, safetensors, tokenizer.json)")
    p.add_argument("--draft", help="DFlash draft checkpoint folder (not needed with --ar)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="below 1e-5 (0, the default) = greedy; higher samples")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; the same seed gives the same output")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the model's end-of-sequence tokens: generate --max-new-tokens tokens")
    p.add_argument("--logit-bias", action="append", metavar="ID=BIAS",
                   help="add BIAS (in [-100, 100]) to the target's logit of token ID (repeatable)")
    p.add_argument("--min-tokens", type=int, default=0, metavar="N",
                   help="the first N tokens are never an end-of-sequence token (taken out of the target's "
                        "distribution there; default 0)")
    add_penalty_flags(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tree-budget", type=int, default=DraftMode.budget,
                      help=f"DDTree nodes drafted per round (default {DraftMode.budget})")
    mode.add_argument("--chain", action="store_true", help="vanilla DFlash: verify the draft's argmax chain")
    mode.add_argument("--ar", action="store_true", help="plain target autoregressive decoding (baseline)")
    p.add_argument("--device", default="auto", help="torch device: auto (cuda when there is a GPU, else cpu), cpu, "
                   "cuda, cuda:1, ... (default auto)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="KV capacity of the session in tokens, prompt and output together (default 2048)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run the draft step and the verify forward eagerly on CUDA (no captured CUDA graphs)")
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: greedy tree decoding equals plain decoding bit for bit in bf16 too")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text + stats")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    mode = DraftMode("ar", 0) if a.ar else DraftMode("chain", 0) if a.chain else None
    if mode is None:
        if a.tree_budget < 0:
            fail(f"--tree-budget must be >= 0, got {a.tree_budget}")
        mode = DraftMode("tree", a.tree_budget)
    if mode.kind != "ar" and not a.draft:
        fail("--draft is required unless --ar is given")
    sampling = SamplingParams(a.temperature, a.top_k, a.top_p, a.seed, **penalty_options(a))
    config = GenerationConfig(a.max_new_tokens, sampling, mode=mode,
                              ignore_eos=a.ignore_eos, min_tokens=a.min_tokens,
                              logit_bias=tuple(sorted(token_biases(a.logit_bias, "--logit-bias").items())))
    try:
        config.check()
    except ValueError as exc:
        fail(str(exc))
    if a.max_seq_len < 2:
        fail(f"--max-seq-len must be >= 2, got {a.max_seq_len}")
    try:
        device = str(parse_device(a.device))
    except ValueError as exc:
        fail(f"--device: {exc}")
    batch_invariant.set_enabled(a.deterministic)
    try:
        engine = LocalEngine.load(a.target, a.draft if mode.kind != "ar" else None, device,
                                  limits=VerifierLimits(max_sessions=1, max_seq_len=a.max_seq_len),
                                  cuda_graphs=not a.no_cuda_graphs)
    except CheckpointError as exc:
        fail(str(exc))
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError and the CPU allocator's are RuntimeErrors
        if not isinstance(exc, (torch.OutOfMemoryError, MemoryError)) and "allocate" not in str(exc):
            raise
        fail(f"out of memory loading the models with --max-seq-len {a.max_seq_len} on {device}: {exc}".split("\n")[0])
    prompt_ids = number_list(a.prompt_ids, "--prompt-ids") if a.prompt_ids is not None else engine.tokenizer.encode(a.prompt).ids
    try:
        result = engine.generate(prompt_ids, config)
    except StatusError as exc:
        fail(exc.message)
    text = engine.tokenizer.decode(result.tokens)
    if a.json:
        print(json.dumps(result_json(result, text)))
        return
    print(text)
    print(
        f"\n[{mode.kind}{'' if mode.kind != 'tree' else f' budget {mode.budget}'}] {len(result.tokens)} tokens, "
        f"{result.rounds} rounds, mean acceptance {result.mean_acceptance:.2f}, "
        f"{result.tokens_per_s:.1f} tokens/s, {result.elapsed_s:.2f} s, finish: {result.finish_reason}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
