"""The two services with random weights at Qwen3-8B dimensions, for bench/serve.py.

    PYTHONPATH=. python bench/serve_roles.py verifier [--small] [--seed 0] [python -m verifier_svc flags...]
    PYTHONPATH=. python bench/serve_roles.py drafter [--small] [--seed 1] [python -m drafter_svc flags...]

`--timeline DIR` records where each step's time goes (`bench/timeline.py`).

Each role is the real service CLI (`verifier_svc.__main__.main`, `drafter_svc.__main__.main`:
flags, environment fallbacks, the real servers, scheduler, link, CUDA graphs, "listening
on" line and SIGTERM handling) with only the checkpoint loaders replaced by builders of
random weights in memory (bfloat16 on CUDA, float32 on CPU; nothing is read from or written
to disk):

* target: 36 layers, hidden 4096, 32 / 8 heads x 128, MLP 12288, vocab 151,936, features
  of layers 1, 9, 17, 25, 33 (`bench/verify.py`'s `qwen3_8b_config`), with a planted
  successor (`plant_successor_`) so that its greedy next token wins by a wide margin;
* draft: the published DFlash Qwen3-8B shape, 5 layers, block 16, the same target layers
  (`bench/verify.py`'s `draft_config`); the drafter's copies of the target's embedding and
  head are random too (their own seed);
* tokenizer: a stand-in that decodes ids to "<id>" text (prompts must be token ids);
* the verifier applies the drafter role's random fc + hidden_norm (default seed) to the
  features, as `--draft` makes it do (`--raw-features` turns that off; a drafter given
  another `--seed` is then refused, its projection fingerprint differing).

Why the planted successor: with plain random weights every logit is a near-tie, so bf16
rounding, which differs between batch and tree shapes, flips the greedy token within a few
steps; tree-mode outputs then leave the AR continuation that the `--bench-oracle` file holds,
and the oracle stops helping (seen on an H200: tau ~ 1.05, no request equal to AR). The
compute is that of any weights of these shapes.

A drafter given `--verifier local` builds the verifier role's random target (seed 0) in its own
process, with the same projection of the features.

`--small` gives toy dimensions (3-layer target, vocab 4096, 2-layer draft, block 8) that
run on a CPU. Do not pass --target or --draft: the role sets them to a label.
"""
from __future__ import annotations

import os.path
import sys

# Run as a script, this folder would shadow the repository's packages (bench/kernels.py vs ddtree_kernels/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.path.dirname(sys.path[0])

import argparse

import torch

from bench.verify import draft_config, qwen3_8b_config, random_draft, random_projection, random_target
from common.config import TargetConfig

RANDOM_LABEL = "(random weights in memory)"
DRAFT_SEED = 1  # the drafter role's default weights seed


def block_size(small: bool) -> int:
    return draft_config(small, qwen3_8b_config(small)).block_size


class PlaceholderTokenizer:
    """What `TextStream` needs of a tokenizer: `decode(ids) -> str`. Random models have no vocabulary."""

    def decode(self, ids) -> str:
        return "".join(f"<{int(i)}>" for i in ids)

    def encode(self, text: str):
        raise ValueError("the random-weight models have no tokenizer: send the prompt as token_ids")

    def encode_batch(self, texts, add_special_tokens: bool = True):
        return [self.encode(text) for text in texts]


EMBED_STD = 32.0  # >> what the 36 random layers add to the residual stream (a few units per element)


@torch.no_grad()
def plant_successor_(model, seed: int) -> None:
    """Make token x's greedy successor perm^-1[x], by a wide margin: large random embeddings keep the
    final hidden state close to the last token's embedding, and head row v is the embedding of
    token perm[v]. EOS gets a zero head row, so generations run to their length."""
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    gen = torch.Generator(device=embed.device).manual_seed(seed + 7)
    embed.normal_(0.0, EMBED_STD, generator=gen)
    perm = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
    head.copy_(embed[perm] * (0.02 / EMBED_STD))
    for eos in model.cfg.eos_token_ids:
        head[eos] = 0


def planted_target(cfg: TargetConfig, layer_ids, device, dtype, seed: int):
    model = random_target(cfg, layer_ids, device, dtype, seed=seed)
    plant_successor_(model, seed)
    return model


def target_label(small: bool, seed: int) -> str:
    """The --target the verifier role passes: it names the random target, so that tensor-parallel
    ranks (processes of their own) build the same one."""
    return f"{RANDOM_LABEL} {'small' if small else '8b'} seed {seed}"


def _patch_verifier_loaders(label: str) -> None:
    """Make the verifier's CLI and loaders read the configs and weights of the random target `label` names."""
    import verifier_svc.__main__ as cli
    import verifier_svc.server as server

    words = label.split()
    small, seed = words[-3] == "small", int(words[-1])
    cfg = qwen3_8b_config(small)
    # The CLI and load_runner read the configs, then the weights, through these names.
    cli.load_target_config = server.load_target_config = lambda folder: cfg
    cli.load_draft_config = lambda folder: draft_config(small, cfg)
    server.TargetModel.from_pretrained = classmethod(
        lambda cls, folder, feature_layer_ids=(), device="cpu", dtype=torch.float32:
        planted_target(cfg, tuple(feature_layer_ids), torch.device(device), dtype, seed))
    server.FeatureProjection.from_draft = classmethod(
        lambda cls, folder, device="cpu", dtype=torch.float32: random_projection(small, torch.device(device), dtype,
                                                                             DRAFT_SEED))


def random_runner(config, rank: int = 0, world: int = 1):
    """`verifier_svc.server.load_runner` over the random target (what every tensor-parallel rank calls)."""
    import verifier_svc.server as server

    _patch_verifier_loaders(config.target_dir)
    return server.load_runner(config, rank, world)


def run_verifier(small: bool, seed: int, argv: list[str]) -> None:
    """`python -m verifier_svc --draft` over a random-weight target, applying the drafter role's
    (default seed) random fc + hidden_norm to the features unless --raw-features is given."""
    import verifier_svc.__main__ as cli

    label = target_label(small, seed)
    _patch_verifier_loaders(label)
    cli.main(["--target", label, "--draft", RANDOM_LABEL, *argv], load=random_runner)


def run_drafter(small: bool, seed: int, argv: list[str]) -> None:
    """`python -m drafter_svc` over a random-weight draft (and random target embedding / head)."""
    import drafter_svc.__main__ as cli
    import drafter_svc.server as server

    target = qwen3_8b_config(small)
    draft = draft_config(small, target)
    # DrafterEngine.start reads configs, tokenizer and weights through these names.
    server.load_target_config = lambda folder: target
    server.load_draft_config = lambda folder: draft
    server.load_tokenizer = lambda folder: PlaceholderTokenizer()
    proposer_cls = server.DFlashProposer

    def from_pretrained(cls, draft_dir, target_dir, device="cpu", dtype=torch.float32, max_seq_len=2048, slots=8,
                        cuda_graphs=True, graph_config=None, projected_features=False, target_weights=None):
        # The draft's embedding and head are its own random ones, also beside an in-process target
        # (`target_weights`, which the product shares instead), so that both setups draft alike.
        model, embed, head = random_draft(small, torch.device(device), dtype, seed)
        return proposer_cls(model, embed, head, max_seq_len, slots, cuda_graphs, graph_config, projected_features)

    proposer_cls.from_pretrained = classmethod(from_pretrained)
    if _verifier_flag(argv) == "local":  # the target in this process: the verifier role's (seed 0)
        _patch_verifier_loaders(target_label(small, 0))
    cli.main(["--target", RANDOM_LABEL, "--draft", RANDOM_LABEL, *argv])


def _verifier_flag(argv: list[str]) -> str:
    """The drafter's --verifier (or VERIFIER_ADDR) in `argv`."""
    value = os.environ.get("VERIFIER_ADDR", "")
    for i, arg in enumerate(argv):
        if arg == "--verifier" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--verifier="):
            value = arg.split("=", 1)[1]
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1], allow_abbrev=False)
    p.add_argument("role", choices=("verifier", "drafter"), help="which service's half of the run this process plays")
    p.add_argument("--small", action="store_true", help="toy dimensions (runs on CPU)")
    p.add_argument("--seed", type=int, default=None,
                   help="weights seed (default 0 for the verifier, 1 for the drafter)")
    p.add_argument("--timeline", metavar="DIR", default=None,
                   help="record host spans and device intervals into DIR (bench/timeline.py reads them)")
    a, rest = p.parse_known_args(argv)
    if a.timeline:
        from bench.timeline import install

        install(a.timeline, "colocated" if a.role == "drafter" and _verifier_flag(rest) == "local" else a.role)
    if a.role == "verifier":
        run_verifier(a.small, 0 if a.seed is None else a.seed, rest)
    else:
        run_drafter(a.small, DRAFT_SEED if a.seed is None else a.seed, rest)


if __name__ == "__main__":
    main(sys.argv[1:])
