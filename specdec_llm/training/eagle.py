"""EAGLE-style feature-level drafts: training (``specdec-llm distill --kind eagle``) and saving.

An :class:`EagleDraft` is one Llama decoder layer that reads the target's own hidden
states. At position ``j`` of the draft's KV cache sits the pair (feature for position ``j``,
token ``x_{j+1}``); the layer's output there predicts ``x_{j+2}``.

- ``feature_layers``: target decoder layers whose outputs (the residual stream after the
  layer, before the final norm) are concatenated into the target feature ``f_j``
  (EAGLE-3 style low / middle / high; ``[N-1]`` alone is EAGLE-1's feature).
- ``fuse(f) -> g``: a Linear ``len(feature_layers)*H -> H`` (no bias).
- ``inputs(ids, g) = fc(cat(embed(ids), g))``: a Linear ``2H -> H`` (no bias), so the decoder
  layer stays shaped like the target's and any Llama forward runs it on ``inputs_embeds``.
- ``model``: a one-layer model of the target's class; its embedding, final norm and rotary
  embedding are the target's tensors, its head the target's or a :class:`~specdec_llm.pairs.SubsetHead`
  (the model, ``build_eagle`` and ``load_eagle_dir`` live in ``specdec_llm.pairs``, beside the
  registry that loads them).
  The draft's feature ``h`` is the residual stream after its layer 0 (before the final norm);
  ``logits(h) = lm_head(norm(h))``.

Drafting: step 1 feeds real features, ``u_j = inputs(x_{j+1}, fuse(f_j))``; step ``s >= 2``
feeds the draft's own previous output instead, ``u = inputs(x_{j+1}, h_{s-1, j-1})`` (not fused
again). Training runs the same thing ("training-time test", EAGLE-3): every step at every
position of a teacher-forced sequence at once, with the attention mask the cache would have
at inference (:func:`ttt_mask`), and a cross-entropy to the target's own argmax.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from ..engine import hf
from ..pairs import (
    DRAFT_META,
    KIND,
    SHARED_TENSORS,
    VOCAB_SUBSET,
    EagleDraft,
    PairError,
    SubsetHead,
    build_eagle,
    default_feature_layers,
    fingerprint,
    reference,
)
from .loop import Schedule, TrainLoop, subset_rows


# -- training-time test: all steps at once ------------------------------------------------
def ttt_mask(width: int, step: int, device=None) -> torch.Tensor:
    """Which keys step ``step``'s query at position ``j`` sees, ``[width, step*width]`` bool.

    Keys are the concatenation of steps 1..step (``width`` positions each). Step ``s`` at
    ``j`` sees step-1 keys at positions ``<= j-s+1``, and for each ``2 <= t <= s`` the step-t
    key at ``j-s+t`` (itself for ``t = s``): at inference, the real pairs up to ``j-s+1`` and
    the pairs drafted since, one per step."""
    j = torch.arange(width, device=device)[:, None]
    i = torch.arange(width, device=device)[None, :]
    blocks = [i <= j - step + 1]
    blocks += [i == j - step + t for t in range(2, step + 1)]
    return torch.cat(blocks, 1)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive ``[1, 1, Q, K]`` float mask every attention backend takes."""
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.masked_fill_(~mask, torch.finfo(dtype).min)[None, None]


def ttt_forward(draft: EagleDraft, ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Every TTT step at every position of teacher-forced sequences.

    ``ids`` ``[B, T]``, ``feats`` ``[B, T, F]`` (the target's features). Pair ``j`` (0..T-2)
    is ``(f_j, x_{j+1})`` at RoPE position ``j``. Returns ``steps`` tensors ``[B, T-1, H]``: the
    draft's output ``h_{s,j}``, predicting ``x_{j+2}``; step ``s`` is meaningful for ``j >= s-1``."""
    from transformers import DynamicCache

    width = ids.shape[1] - 1
    tok = ids[:, 1:]
    pos = torch.arange(width, device=ids.device)[None]
    cache = DynamicCache(config=draft.model.config)
    h = None
    outs = []
    for s in range(1, steps + 1):
        if s == 1:
            g = draft.fuse(feats[:, :-1].to(draft.dtype))
        else:  # the previous step's output one position back (position 0 has none: zeros, never scored)
            g = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
        u = draft.inputs(tok, g)
        h = draft.layer(u, pos, _additive(ttt_mask(width, s, ids.device), u.dtype), cache)
        outs.append(h)
    return outs


# -- teacher signals -----------------------------------------------------------------------
@torch.no_grad()
def teacher_signals(target, ids: torch.Tensor, attention_mask: torch.Tensor, layers: list[int]):
    """Teacher-forced target forward: features ``[B, T, len(layers)*H]`` and argmax ``[B, T]``."""
    with hf.layer_outputs(target, tuple(layers)) as got:
        hidden = target.model(input_ids=ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    argmax = torch.cat([target.lm_head(hidden[:, c : c + 64]).argmax(-1) for c in range(0, hidden.shape[1], 64)], 1)
    return torch.cat(got, -1), argmax


def _window(tokens, prompt_len: int, max_len: int) -> tuple[torch.Tensor, int]:
    """At most ``max_len`` tokens, keeping the answer's start: a long prompt loses its head."""
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    start = max(0, min(prompt_len - max_len // 4, len(tokens) - max_len))
    return tokens[start : start + max_len], prompt_len - start


def as_records(examples, max_len: int) -> list[tuple[torch.Tensor, int]]:
    """``(tokens, prompt_len)`` windows from corpus records (``.tokens``/``.prompt_len``) or
    tuples ``(tokens, prompt_len, ...)`` (a distill DataStore's examples); records with fewer
    than two answer tokens are dropped."""
    out = []
    for ex in examples:
        tokens, plen = (ex.tokens, ex.prompt_len) if hasattr(ex, "tokens") else (ex[0], ex[1])
        seq, plen = _window(tokens, int(plen), max_len)
        if len(seq) - plen >= 2:
            out.append((seq, plen))
    return out


def corpus_examples(target, root: Path | None = None) -> list:
    """The token records of ``root``: a ``specdec_llm.training.corpus`` corpus (default
    ``data/corpus/<target fingerprint>``) or a ``specdec-llm distill`` data directory."""
    root = root or Path("data/corpus") / fingerprint(target)
    if (root / "manifest.json").exists() and any(root.glob("shard-*.safetensors")):  # a distill DataStore
        from .distill import DataStore

        return list(DataStore(root).examples())
    if not root.is_dir():
        raise PairError(f"no token corpus at {root}: build one (specdec-llm corpus grow) or pass --corpus DIR")
    from .corpus import Corpus  # written alongside; imported only when used

    return list(Corpus(root).records())


class TeacherCache:
    """Target features (bf16) and argmax per record, in safetensors shards under ``root``;
    a shard whose records changed (digest) is recomputed, the others are read back."""

    def __init__(self, root: Path, shard_records: int = 64):
        self.root = root
        self.shard_records = shard_records
        self.index_path = root / "index.json"
        self.index = json.loads(self.index_path.read_text()) if self.index_path.exists() else {}
        self.handles: dict[int, object] = {}
        self.spans: list[tuple[int, int, int]] = []  # per record: shard, start, end

    def build(self, target, records, layers: list[int], batch: int = 8, progress=None) -> int:
        """Fill in missing shards; returns how many were computed."""
        self.root.mkdir(parents=True, exist_ok=True)
        n_shards = math.ceil(len(records) / self.shard_records)
        task = progress.add_task("target features", total=n_shards) if progress else None
        computed = 0
        self.spans = []
        dev = next(target.parameters()).device
        for s in range(n_shards):
            recs = records[s * self.shard_records : (s + 1) * self.shard_records]
            h = hashlib.sha256()
            for seq, plen in recs:
                h.update(seq.numpy().astype("int64").tobytes() + str(plen).encode() + b";")
            digest = h.hexdigest()[:16]
            path = self.root / f"shard-{s:05d}.safetensors"
            if self.index.get(str(s)) != digest or not path.exists():
                feats, argm = [], []
                for b in range(0, len(recs), batch):
                    rows = [r[0] for r in recs[b : b + batch]]
                    width = max(len(r) for r in rows)
                    ids = torch.zeros(len(rows), width, dtype=torch.long)
                    am = torch.zeros(len(rows), width, dtype=torch.long)
                    for i, r in enumerate(rows):
                        ids[i, : len(r)] = r
                        am[i, : len(r)] = 1
                    f, a = teacher_signals(target, ids.to(dev), am.to(dev), layers)
                    for i, r in enumerate(rows):
                        feats.append(f[i, : len(r)].to(torch.bfloat16).cpu())
                        argm.append(a[i, : len(r)].to(torch.int32).cpu())
                self.handles.pop(s, None)
                save_file({"feat": torch.cat(feats), "argmax": torch.cat(argm)}, str(path))
                self.index[str(s)] = digest
                tmp = self.index_path.with_suffix(".tmp")
                tmp.write_text(json.dumps(self.index))
                tmp.replace(self.index_path)
                computed += 1
            pos = 0
            for seq, _ in recs:
                self.spans.append((s, pos, pos + len(seq)))
                pos += len(seq)
            if progress:
                progress.advance(task)
        return computed

    def get(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, a, b = self.spans[r]
        if s not in self.handles:
            self.handles[s] = safe_open(str(self.root / f"shard-{s:05d}.safetensors"), framework="pt")
        h = self.handles[s]
        return h.get_slice("feat")[a:b], h.get_slice("argmax")[a:b].long()


# -- loss and agreement ----------------------------------------------------------------------
def _batch(records, cache: TeacherCache, idx: list[int], device):
    """Padded ``ids``, ``feats`` and per-pair labels (-100: not scored) for records ``idx``.

    Pair ``j`` is labelled with the target's argmax at ``j+1`` (its prediction of ``x_{j+2}``),
    scored where that is an answer token (``j+2 >= prompt_len``)."""
    width = max(len(records[i][0]) for i in idx)
    feats = None
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    labels = torch.full((len(idx), width - 1), -100, dtype=torch.long)
    for b, i in enumerate(idx):
        seq, plen = records[i]
        f, a = cache.get(i)
        if feats is None:
            feats = torch.zeros(len(idx), width, f.shape[-1], dtype=f.dtype)
        n = len(seq)
        ids[b, :n] = seq
        feats[b, :n] = f
        first = max(0, plen - 2)
        labels[b, first : n - 1] = a[first + 1 : n]
    return ids.to(device), feats.to(device), labels.to(device)


def _step_weights(steps: int, decay: float) -> list[float]:
    return [decay**s for s in range(steps)]


def ttt_loss(draft, ids, feats, labels, steps: int, decay: float, subset_pos: torch.Tensor | None):
    """Weighted sum over steps of the cross-entropy to the target's argmax (over the head's
    tokens; labels outside a subset head are skipped). Returns loss, per-step (hits, count)."""
    outs = ttt_forward(draft, ids, feats, steps)
    rows = labels if subset_pos is None else subset_pos[labels.clamp_min(0)].masked_fill(labels < 0, -100)
    total = 0.0
    stats = []
    for s, (h, w) in enumerate(zip(outs, _step_weights(steps, decay))):
        lab = rows.clone()
        lab[:, :s] = -100  # step s+1 needs s earlier positions
        keep = lab >= 0
        logits = draft.subset_logits(h[keep]).float()
        if keep.any():
            total = total + w * F.cross_entropy(logits, lab[keep])
        scored = labels.clone()
        scored[:, :s] = -100
        stats.append((int((logits.argmax(-1) == lab[keep]).sum()), int((scored >= 0).sum())))
    return total, stats


@torch.no_grad()
def heldout_agreement(draft, records, cache, idx: list[int], steps: int, subset_pos, batch: int = 8) -> list[float]:
    """Teacher-forced agreement (draft argmax == target argmax) per TTT step on records ``idx``;
    a label outside a subset head counts as a miss."""
    was = draft.training
    draft.eval()
    hits, total = [0] * steps, [0] * steps
    for b in range(0, len(idx), batch):
        ids, feats, labels = _batch(records, cache, idx[b : b + batch], draft.device)
        _, stats = ttt_loss(draft, ids, feats, labels, steps, 1.0, subset_pos)
        for s, (h, n) in enumerate(stats):
            hits[s] += h
            total[s] += n
    draft.train(was)
    return [round(h / n, 4) if n else 0.0 for h, n in zip(hits, total)]


# -- save / load ---------------------------------------------------------------------------------
def save_eagle(draft: EagleDraft, out: Path, target, extra: dict, dtype: str = "bfloat16") -> None:
    """A draft directory the pair registry loads: its own tensors, the config, the meta."""
    out.mkdir(parents=True, exist_ok=True)
    own = {k: v.detach().to(getattr(torch, dtype)).cpu().contiguous() for k, v in draft.own_state().items()}
    head = draft.model.lm_head
    if isinstance(head, SubsetHead):
        own[VOCAB_SUBSET] = head.ids.to(torch.int32).cpu()
    save_file(own, str(out / "draft.safetensors"))
    draft.model.config.to_json_file(str(out / "config.json"))
    meta = {
        "format": 1,
        "kind": KIND,
        "target": reference(target),
        "target_fingerprint": fingerprint(target),
        "feature_layers": draft.feature_layers,
        "vocab_subset": len(head.ids) if isinstance(head, SubsetHead) else 0,
        "shared": SHARED_TENSORS,
        **extra,
    }
    tmp = out / (DRAFT_META + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.replace(out / DRAFT_META)


# -- training -------------------------------------------------------------------------------------
@dataclass
class EagleConfig:
    feature_layers: list[int] | None = None  # default: [1, N//2, N-1]
    ttt_steps: int = 3
    step_decay: float = 0.8  # loss weight of step s: decay**(s-1)
    steps: int = 2000
    batch_size: int = 8
    lr: float = 5e-4
    warmup: int = 50
    max_len: int = 256
    checkpoint_every: int = 100
    vocab_subset: int = 16384  # head over this many most frequent tokens (0: the full vocabulary)
    save_dtype: str = "bfloat16"
    holdout: int = 64  # records never trained on; agreement measured on them at each checkpoint
    init: str = "last"  # the decoder layer: a copy of the target's last layer, or random
    teacher_batch: int = 8
    seed: int = 0
    history_every: int = 10


def choose_subset(records, cache: TeacherCache, size: int, vocab: int, always: list[int]) -> torch.Tensor:
    """The ``size`` token ids the head keeps: the most frequent target argmax labels and answer
    tokens, then the lowest ids, plus ``always`` (end-of-sequence tokens). Sorted."""
    counts = torch.zeros(vocab)
    for r, (seq, plen) in enumerate(records):
        counts += torch.bincount(seq[plen:], minlength=vocab)[:vocab].float()
        counts += torch.bincount(cache.get(r)[1][max(0, plen - 1) :], minlength=vocab)[:vocab].float()
    if always:
        counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    score = counts + 1e-6 * (vocab - torch.arange(vocab)) / vocab
    return torch.topk(score, min(size, vocab)).indices.sort().values


def heldout_indices(records, n: int, seed: int = 0) -> list[int]:
    """The ``n`` records kept out of training: those whose tokens hash lowest, so a record
    stays held out (or trained on) when the corpus grows or is re-read in another order."""

    def key(r: int) -> str:
        seq, plen = records[r]
        return hashlib.sha256(f"{seed}:{plen}:".encode() + seq.numpy().astype("int64").tobytes()).hexdigest()

    return sorted(sorted(range(len(records)), key=key)[:n])


def _prepare(target, examples, work: Path, cfg: EagleConfig, loop: TrainLoop, progress=None):
    """The run's records and teacher cache (computed where missing: how many shards, too),
    its held-out and training record indices and its vocabulary subset (None: the full
    head). A resumed checkpoint's shape wins over the command line's (``cfg`` is updated)."""
    if loop.state is not None:
        for k in ("feature_layers", "ttt_steps", "max_len", "init", "vocab_subset", "seed", "holdout"):
            setattr(cfg, k, loop.state["config"][k])
    layers = list(cfg.feature_layers) if cfg.feature_layers else default_feature_layers(len(target.model.layers))
    cfg.feature_layers = layers
    records = as_records(examples, cfg.max_len)
    if len(records) < 2:
        raise ValueError("EAGLE training needs at least two token records with an answer")
    key = hashlib.sha256(f"{fingerprint(target)}:{layers}".encode()).hexdigest()[:12]
    cache = TeacherCache(work / "eagle-teacher" / key)
    computed = cache.build(target, records, layers, cfg.teacher_batch, progress)
    held = heldout_indices(records, min(cfg.holdout, len(records) // 10 or 1), cfg.seed)
    held_set = set(held)
    train_idx = [i for i in range(len(records)) if i not in held_set]
    subset = loop.saved_subset()
    if loop.state is None and cfg.vocab_subset and cfg.vocab_subset < target.config.vocab_size:
        eos = target.generation_config.eos_token_id
        always = [eos] if isinstance(eos, int) else list(eos or [])
        subset = choose_subset([records[i] for i in train_idx], _Sub(cache, train_idx), cfg.vocab_subset,
                               target.config.vocab_size, always)  # fmt: skip
    return records, cache, computed, held, train_idx, subset


def _index_batches(train_idx: list[int], batch_size: int, rng: random.Random):
    """Batches of record indices, reshuffled each pass, forever."""
    order = list(train_idx)
    while True:
        rng.shuffle(order)
        for i in range(0, max(1, len(order) - batch_size + 1), batch_size):
            yield order[i : i + batch_size]


def _export(draft: EagleDraft, loop: TrainLoop, out: Path, target, cfg: EagleConfig, records: int, held: int) -> None:
    """The draft directory the pair registry loads, with the run's figures so far."""
    train_meta = {
        "steps": loop.step,
        "tokens_seen": loop.tokens_seen,
        "records": records,
        "heldout_records": held,
        "config": asdict(cfg),
        "heldout_curve": loop.heldout_curve(),
    }
    save_eagle(draft, out, target, {"ttt_steps": cfg.ttt_steps, "init": cfg.init, "train": train_meta}, cfg.save_dtype)


def train_eagle(target, examples, work: Path, out: Path, cfg: EagleConfig, resume: bool, progress=None, deadline=None):
    """Train an EAGLE draft on ``examples`` (token records); checkpoints in ``work/eagle-ckpt``,
    teacher signals cached in ``work/eagle-teacher``, the draft exported to ``out``."""
    dev = next(target.parameters()).device
    target = target.float().eval()
    loop = TrainLoop(work / "eagle-ckpt", resume)
    records, cache, computed, held, train_idx, subset = _prepare(target, examples, work, cfg, loop, progress)
    draft = build_eagle(target, cfg.feature_layers, subset, cfg.init)
    subset_pos = subset_rows(subset, target.config.vocab_size, dev)
    params = draft.own_parameters()
    for p in params:
        p.requires_grad_(True)
    draft.train()
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    loop.restore(draft, opt, params, dev)
    stream = _index_batches(train_idx, cfg.batch_size, random.Random(cfg.seed + loop.step))
    task = progress.add_task("training eagle", total=cfg.steps, completed=loop.step) if progress else None

    def loss_step():
        idx = next(stream)
        ids, feats, labels = _batch(records, cache, idx, dev)
        loss, stats = ttt_loss(draft, ids, feats, labels, cfg.ttt_steps, cfg.step_decay, subset_pos)
        return loss, sum(len(records[i][0]) for i in idx), (float(loss.detach()), [h / max(1, n) for h, n in stats])

    def record(window: list) -> dict:
        ml = sum(w[0] for w in window) / len(window)
        ma = [round(sum(w[1][s] for w in window) / len(window), 4) for s in range(cfg.ttt_steps)]
        if progress:
            progress.update(task, completed=loop.step, description=f"eagle loss={ml:.3f} agree={ma}")
        return {"loss": round(ml, 4), "agreement": ma}

    def checkpoint() -> None:
        if loop.wants_heldout():
            agree = heldout_agreement(draft, records, cache, held, cfg.ttt_steps, subset_pos, cfg.batch_size)
            loop.history[-1]["heldout_agreement"] = agree
            if progress:
                progress.console.print(
                    f"eagle: step {loop.step} tokens {loop.tokens_seen:,} held-out agreement by step {agree}"
                )
        loop.save(draft.own_state(), opt, params, subset, asdict(cfg))
        _export(draft, loop, out, target, cfg, len(records), len(held))

    schedule = Schedule(cfg.steps, cfg.lr, cfg.warmup, cfg.checkpoint_every, cfg.history_every)
    loop.run(loss_step, opt, params, schedule, record, checkpoint, deadline, close_history=True)
    return {
        "steps": loop.step,
        "tokens_seen": loop.tokens_seen,
        "teacher_shards_computed": computed,
        "seconds_per_step": round(loop.seconds / max(1, loop.step - loop.start), 3),
        "history": loop.history[-3:],
    }


class _Sub:
    """A TeacherCache view over records ``idx`` (so ``get(r)`` reads record ``idx[r]``)."""

    def __init__(self, cache: TeacherCache, idx: list[int]):
        self.cache, self.idx = cache, idx

    def get(self, r: int):
        return self.cache.get(self.idx[r])
