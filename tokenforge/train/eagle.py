"""`tokenforge train --draft-head eagle|eagle3`: train an EAGLE or EAGLE-3 head on the target's
own features.

In: the target model (frozen) and its own generations for a prompt set (self-distillation: the
CLI generates them with the engine and writes RUN/distill/sequences.jsonl, one token list per
line, prompt + output). Out: RUN/checkpoints/step_*/ (resumable, as `tokenforge train`'s),
RUN/metrics.jsonl and RUN/final/, the head in the layout the server loads
(model/loader/eagle.py: config.json + model.safetensors, the authors' tensor names).

The head (one decoder layer, model/models/eagle.py) sees at position p the next token and the
target's final-normed feature f_p, and is trained to predict f_{p+1}: a smooth-L1 loss on the
feature plus a cross-entropy loss of the target's LM head over the prediction against token
p+2 as the target would pick it (the argmax of its LM head on f_{p+1}; on the target's own
greedy answers that is the sequence's token, on sampled answers and prompt text it is not;
EagleLoss(labels="data") takes the sequence's).

An EAGLE-3 head (DraftHead(version=3)) reads instead the residual streams entering three target
layers (default_aux_layers), has no feature loss, and its own LM head over a draft vocabulary:
the training text's most frequent tokens (`draft_vocabulary`), its rows and final norm started
from the target's; a position whose label is outside it teaches nothing. Each draft reads that
smaller LM head (the per-draft cost EAGLE's full one dominates on small targets).

The features come from the frozen target's forward over each
batch (kept on the device for the whole run when they fit in `feature_cache_bytes`, else
recomputed per step). One process, or DDP under torchrun (the head's gradients all-reduced;
each rank takes its slice of every global batch); optimizer, schedule and checkpoints are the
training mode's own (optim.py, checkpoint.py).
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenforge.model.forward_context import TrainingMetadata, UnrolledMetadata, set_forward_context
from tokenforge.model.loader import load_model
from tokenforge.model.loader.eagle import save_eagle_head
from tokenforge.model.models.eagle import EagleHead
from tokenforge.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tokenforge.train.config import TrainConfig
from tokenforge.train.data import SampleOrder
from tokenforge.train.draft_heads import DraftHead, draft_vocabulary, head_spec, init_head, run_with_streams
from tokenforge.train.loss import IGNORE_INDEX, linear_cross_entropy
from tokenforge.train.metrics import MetricsLogger
from tokenforge.train.optim import build_optimizer, build_scheduler
from tokenforge.train.parallel import Dist, destroy_distributed, init_distributed, unwrap, wrap_model
from tokenforge.train.setup import compute_dtype, resolve_strategy

logger = logging.getLogger(__name__)
SEQUENCES = "distill/sequences.jsonl"


@dataclass(frozen=True, slots=True)
class EagleLoss:
    feature_weight: float = 1.0
    token_weight: float = 0.5
    feature_cache_bytes: int = 2 << 30
    # token-loss labels: "target" = the target's argmax after the next position (what a greedy
    # verify accepts; sampled or prompt text does not teach the head other tokens), "data" = the
    # sequence's own next-next token
    labels: str = "target"
    # training-time test (EAGLE-3's): draft depths trained per position, each fed the head's own
    # predicted feature from the depth before (1: the target's features only, EAGLE's training)
    ttt_length: int = 1
    ttt_decay: float = 0.8           # depth d's loss weight: ttt_decay ** d

    def __post_init__(self) -> None:
        if self.ttt_length < 1 or self.ttt_decay <= 0:
            raise ValueError(f"EagleLoss: ttt_length must be >= 1 and ttt_decay > 0, got {self.ttt_length}, "
                             f"{self.ttt_decay}")


def _shifted(x: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """x[:, start:start + n], zero-padded at the end to n columns (what runs past a row's end is
    masked by the caller)."""
    part = x[:, start:start + n]
    if part.shape[1] == n:
        return part
    pad = torch.zeros((x.shape[0], n - part.shape[1], *x.shape[2:]), dtype=x.dtype, device=x.device)
    return torch.cat([part, pad], dim=1)


def read_sequences(path: Path) -> list[list[int]]:
    with open(path) as f:
        seqs = [json.loads(line) for line in f if line.strip()]
    seqs = [s for s in seqs if len(s) >= 3]
    if not seqs:
        raise ValueError(f"{path} holds no sequence of 3 or more tokens to train a draft head on")
    return seqs


class EagleTrainer:
    def __init__(self, cfg: TrainConfig, d: Dist, loss: EagleLoss, sequences: list[list[int]],
                 max_seconds: float | None = None, head: DraftHead = DraftHead()) -> None:
        self.cfg, self.d, self.loss_cfg, self.max_seconds, self.head_cfg = cfg, d, loss, max_seconds, head
        self.run_dir = Path(cfg.output)
        self.dtype = compute_dtype(cfg, d.device)
        torch.manual_seed(cfg.seed)
        loaded = load_model(cfg.model, cfg.load_format, self.dtype, d.device, cfg.seed)
        self.target = loaded.model.eval().requires_grad_(False)
        self.arch = loaded.arch_config
        self.seqs = [s[:cfg.seq_len] for s in sequences]
        strategy = resolve_strategy(cfg, d.world_size)
        self.t2d: torch.Tensor | None = None    # EAGLE-3: target id -> draft id, -1 outside the draft vocabulary
        if head.version == 3:
            if strategy == "fsdp":
                raise ValueError("an EAGLE-3 head trains under --strategy ddp (its LM head is read by the loss, "
                                 "outside the sharded forward FSDP needs)")
            vocab_ids, covered = draft_vocabulary(self.seqs, self.arch.vocab_size, head.draft_vocab_size, head.coverage)
            logger.info("EAGLE-3 draft vocabulary: %d of %d tokens, covering %.2f%% of the training text",
                        len(vocab_ids), self.arch.vocab_size, 100 * covered)
        with torch.device(d.device):
            self.head = EagleHead(head_spec(self.arch, head.version, None if head.version == 1 else len(vocab_ids)),
                                  torch.float32)
        init_head(self.head, cfg.seed)
        if head.version == 3:
            self._start_from_the_target(vocab_ids.to(d.device))
        self.head.share(self.target)
        self.wrapped = wrap_model(self.head, strategy, d, self.dtype)
        self.optimizer = build_optimizer(self.wrapped, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2), d.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.warmup_steps, cfg.max_steps, cfg.scheduler, cfg.min_lr_ratio)
        self.order = SampleOrder(len(self.seqs), cfg.seed)
        self.metrics = MetricsLogger(self.run_dir, d.is_main, cfg.tensorboard)
        self.step = self.position = 0
        self._features: dict[int, torch.Tensor] = {}
        self._labels: dict[int, torch.Tensor] = {}       # with the features: the target's argmax after each
        tokens = sum(len(s) for s in self.seqs)
        self.width = self.arch.hidden_size * (1 if head.version == 1 else len(self.head.spec.aux_layer_ids))
        self._cache = tokens * self.width * self.dtype.itemsize <= loss.feature_cache_bytes

    @torch.no_grad()
    def _start_from_the_target(self, vocab_ids: torch.Tensor) -> None:
        """EAGLE-3: the draft map, and the LM head's rows and final norm taken from the target's, so
        the first steps already read the target's own token directions."""
        n = vocab_ids.numel()
        self.head.d2t.copy_(vocab_ids - torch.arange(n, device=vocab_ids.device))
        self.head.lm_head.weight.copy_(self.target.lm_head.weight[vocab_ids].float())
        self.head.norm.weight.copy_(self.target.model.norm.weight.float())
        self.t2d = torch.full((self.arch.vocab_size,), -1, dtype=torch.long, device=vocab_ids.device)
        self.t2d[vocab_ids] = torch.arange(n, device=vocab_ids.device)

    # ---- data ----

    def _batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, S], lengths [B], target features [B, S, F], the target's argmax tokens [B, S]) of
        the listed sequences."""
        seqs = [self.seqs[i] for i in indices]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for row, s in enumerate(seqs):
            ids[row, :len(s)] = torch.tensor(s)
        ids = ids.to(self.d.device)
        lengths = torch.tensor([len(s) for s in seqs], device=self.d.device)
        missing = [i for i in indices if i not in self._features]
        if missing or not self._cache:
            fresh, fresh_argmax = self._target_features(ids)
            if not self._cache:
                return ids, lengths, fresh, fresh_argmax
            for row, i in enumerate(indices):
                if i not in self._features:
                    self._features[i] = fresh[row, :len(self.seqs[i])].clone()
                    self._labels[i] = fresh_argmax[row, :len(self.seqs[i])].clone()
        feats = torch.zeros(len(seqs), width, self.width, dtype=self.dtype, device=self.d.device)
        argmax = torch.zeros(len(seqs), width, dtype=torch.long, device=self.d.device)
        for row, i in enumerate(indices):
            feats[row, :len(self.seqs[i])] = self._features[i]
            argmax[row, :len(self.seqs[i])] = self._labels[i]
        return ids, lengths, feats, argmax

    @torch.no_grad()
    def _target_features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's input features [B, S, F]: the final-normed hidden state for EAGLE, the residual
        streams entering the feature layers for EAGLE-3; the target's argmax next tokens [B, S])."""
        if self.head_cfg.version == 1:
            final = self.target(ids, None)                                 # [B, S, H], final-normed
            return final, self._target_argmax(final)
        final, feats = run_with_streams(self.target, ids, self.head.spec.aux_layer_ids)
        return feats, self._target_argmax(final)

    # ---- the step ----

    def predictions(self, ids: torch.Tensor, feats: torch.Tensor) -> list[torch.Tensor]:
        """The head's predicted features [B, S-1, H] at each draft depth (EagleLoss.ttt_length of them).
        Depth 0 at p reads (token p+1, f_p) and predicts f_{p+1}; depth d at p reads (token p+d+1,
        depth d-1's prediction at p) at position p+d and predicts f_{p+d+1}: the head's (d+1)-th
        draft after a catch-up that ended at p, fed the tokens a greedy verify accepts, and
        attending what it attends then (forward_context.UnrolledMetadata)."""
        b, s = ids.shape
        n, depth = s - 1, self.loss_cfg.ttt_length
        pos = torch.arange(n, device=ids.device)
        hidden = feats[:, :-1].reshape(b * n, -1).float()
        kv: dict = {}
        out = []
        for d in range(depth):
            meta = TrainingMetadata.of(b, n) if depth == 1 else UnrolledMetadata(b, n, d, kv)
            with set_forward_context(meta):     # depth 0 reads the target's features (EAGLE-3: through fc)
                pred, hidden = self.wrapped(_shifted(ids, 1 + d, n).reshape(-1), (pos + d).repeat(b), hidden, d == 0)
            out.append(pred.view(b, n, -1))
        return out

    def losses(self, ids: torch.Tensor, lengths: torch.Tensor, feats: torch.Tensor,
               argmax: torch.Tensor) -> dict[str, torch.Tensor]:
        """Feature (EAGLE only) and token losses of every draft depth (`predictions`), depth d
        weighted ttt_decay ** d. `argmax`: the target's argmax token after each position. "accuracy"
        is depth 0's (the first draft's), accuracy_d depth d's (EAGLE-3: over the labels its draft
        vocabulary holds)."""
        b, s = ids.shape
        n = s - 1
        pos = torch.arange(n, device=ids.device)
        v3 = self.t2d is not None
        # EAGLE scores its rows with the target's (frozen) LM head, EAGLE-3 with its own
        weight = unwrap(self.wrapped).lm_head.weight if v3 else self.target.lm_head.weight.detach()
        total = feat_total = token_total = 0.0
        norm = 0.0
        stats_out: dict[str, torch.Tensor] = {}
        for d, pred in enumerate(self.predictions(ids, feats)):
            w = self.loss_cfg.ttt_decay ** d
            valid = (pos[None, :] + 1 + d) < lengths[:, None]             # f_{p+d+1} exists
            if v3:                                      # EAGLE-3 predicts tokens only
                feat_loss = torch.zeros((), device=ids.device)
            else:
                feat_err = F.smooth_l1_loss(pred, _shifted(feats, 1 + d, n).float(), reduction="none").mean(-1)
                feat_loss = (feat_err * valid).sum() / valid.sum().clamp(min=1)
            labels = torch.full((b, n), IGNORE_INDEX, dtype=torch.long, device=ids.device)
            if self.loss_cfg.labels == "target":       # what the target would emit after p + d + 1
                labels[valid] = _shifted(argmax, 1 + d, n)[valid]
            else:                                      # the sequence's own token p + d + 2
                labels = torch.where((pos[None, :] + 2 + d) < lengths[:, None], _shifted(ids, 2 + d, n), labels)
            if v3:                                      # as draft ids; outside the draft vocabulary: no label
                drafted = self.t2d[labels.clamp(min=0)]
                labels = torch.where((labels != IGNORE_INDEX) & (drafted >= 0), drafted, IGNORE_INDEX)
            # the vocabulary-wide products (most of a step's work) run over labelled rows only, not
            # over the batch's padding
            keep = labels != IGNORE_INDEX                                 # [B, S-1]
            rows, kept = pred[keep], labels[keep]                         # [m, H], [m]
            count = kept.numel() or 1
            stats: dict = {}                              # the accuracy, from the loss's own logits
            token_loss = linear_cross_entropy(rows, weight, kept, stats=stats) / count
            stats_out["accuracy" if d == 0 else f"accuracy_{d}"] = stats["correct"] / count
            total = total + w * (self.loss_cfg.feature_weight * feat_loss + self.loss_cfg.token_weight * token_loss)
            feat_total = feat_total + w * feat_loss.detach()
            token_total = token_total + w * token_loss.detach()
            norm += w
        return {"loss": total / norm, "feature_loss": feat_total / norm, "token_loss": token_total / norm,
                **stats_out}

    @torch.no_grad()
    def _target_argmax(self, feats: torch.Tensor, rows: int = 4096) -> torch.Tensor:
        """[..., H] target features -> [...] the target's argmax next tokens (chunked over rows)."""
        flat = feats.reshape(-1, feats.shape[-1])
        out = torch.cat([self.target.compute_logits(flat[i:i + rows]).argmax(-1) for i in range(0, len(flat), rows)])
        return out.view(feats.shape[:-1])

    def one_step(self) -> dict[str, float]:
        mb, world = self.cfg.micro_batch_size, self.d.world_size
        indices = self.order.indices(self.position + self.d.rank * mb, mb)
        out = self.losses(*self._batch(indices))
        out["loss"].backward()
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_([p for p in self.wrapped.parameters() if p.requires_grad], clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += mb * world
        return {"step": self.step, **{k: float(v.detach()) for k, v in out.items()}, "lr": lr, "grad_norm": float(norm)}

    # ---- the run ----

    def fit(self) -> Path | None:
        self._maybe_resume()
        tic = time.perf_counter()
        while self.step < self.cfg.max_steps:
            record = self.one_step()
            if self._out_of_time(tic):
                logger.warning("stopping at step %d: --max-seconds %.0f spent", self.step, self.max_seconds)
                self.metrics.log({**record, "seconds": time.perf_counter() - tic})
                break
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps:
                record["seconds"] = time.perf_counter() - tic
                self.metrics.log(record)
                if self.d.is_main:
                    logger.info("step %d loss %.4f feature %.4f token %.4f accuracy %.3f", self.step, record["loss"],
                                record["feature_loss"], record["token_loss"], record["accuracy"])
            if self.cfg.save_every and self.step % self.cfg.save_every == 0 and self.step < self.cfg.max_steps:
                self._save()
        self._save()
        self.metrics.close()
        return self._export()

    def _out_of_time(self, tic: float) -> bool:
        """Past --max-seconds (rank 0's clock decides, so every DDP rank stops at the same step)."""
        if self.max_seconds is None:
            return False
        late = torch.tensor(float(time.perf_counter() - tic > self.max_seconds), device=self.d.device)
        if self.d.world_size > 1:
            torch.distributed.broadcast(late, 0)
        return bool(late.item())

    def _state(self) -> dict:
        return {"step": self.step, "position": self.position, "seed": self.cfg.seed, "seq_len": self.cfg.seq_len,
                "num_sequences": len(self.seqs), "draft_head": self._kind(),
                "draft_vocab_size": self.head.spec.draft_vocab_size}

    def _kind(self) -> str:
        return "eagle" if self.head_cfg.version == 1 else "eagle3"

    def _save(self) -> Path:
        return save_checkpoint(self.run_dir, self.wrapped, self.optimizer, self.scheduler, self._state(), self.d,
                               self.cfg.keep_last)

    def _maybe_resume(self) -> None:
        path = latest_checkpoint(self.run_dir) if self.cfg.resume else None
        if path is None:
            return
        saved = json.loads((path / "trainer.json").read_text())
        kind, vocab = saved.get("draft_head", "eagle"), saved.get("draft_vocab_size", self.arch.vocab_size)
        if (kind, vocab) != (self._kind(), self.head.spec.draft_vocab_size):
            raise ValueError(f"cannot resume from {path}: it holds an {kind} head with a draft vocabulary of {vocab} "
                             f"tokens, this run trains an {self._kind()} head with {self.head.spec.draft_vocab_size}")
        meta = load_checkpoint(path, self.wrapped, self.optimizer, self.scheduler, self.d)
        if meta.get("num_sequences") != len(self.seqs):
            raise ValueError(f"cannot resume from {path}: it was trained on {meta.get('num_sequences')} sequences, "
                             f"{self.run_dir / SEQUENCES} now holds {len(self.seqs)}")
        self.step, self.position = meta["step"], meta["position"]
        logger.warning("resumed from %s (step %d)", path, self.step)

    def _export(self) -> Path | None:
        if not self.d.is_main:
            self.d.barrier()
            return None
        dtype = self.dtype if self.cfg.export_dtype == "auto" else getattr(torch, self.cfg.export_dtype)
        out = save_eagle_head(unwrap(self.wrapped), self.run_dir / "final", dtype,
                              {"tokenforge_draft_head": {"target": str(self.cfg.model), "steps": self.step}})
        self.d.barrier()
        return out


def train_eagle_head(cfg: TrainConfig, loss: EagleLoss | None = None, max_seconds: float | None = None,
                     head: DraftHead = DraftHead()) -> Path | None:
    """Train on RUN/distill/sequences.jsonl (written by the CLI); returns RUN/final (rank 0).
    `max_seconds`: stop (checkpoint and export) after that much training time, steps left or not."""
    cfg = cfg.validated()
    sequences = read_sequences(Path(cfg.output) / SEQUENCES)
    d = init_distributed(cfg.device)
    try:
        return EagleTrainer(cfg, d, loss or EagleLoss(), sequences, max_seconds, head).fit()
    finally:
        destroy_distributed()
