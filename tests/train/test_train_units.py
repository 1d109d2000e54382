"""Pieces of the trainer: the training path of the model against the serving path, the chunked
cross-entropy against the plain one, the learning-rate schedule, the sample order, a smoke
run of `tokenforge bench train`, and the clean-up of run folders that killed test runs left in RAM."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from tokenforge.model.forward_context import set_forward_context
from tokenforge.train.data import SampleOrder
from tokenforge.train.loss import linear_cross_entropy, reference_cross_entropy
from tokenforge.train.optim import lr_factor


def test_training_path_matches_serving_path(bundled_model):
    ids = torch.randint(0, 4000, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        train = bundled_model(ids, None)                                   # [2, 12, H]
        with set_forward_context(None):
            serve = torch.stack([bundled_model(row, torch.arange(12)) for row in ids])
    # float32 sums in another order (one [2, 12] batch vs two rows): on this host's CPU one element
    # of 13,824 differs by 3.1e-5 with main's code too (568b26f); a wrong path differs by ~1e-2
    torch.testing.assert_close(train, serve, atol=5e-5, rtol=1e-5)


def test_chunked_cross_entropy_matches_full_logits():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    loss = linear_cross_entropy(h, w, labels, chunk_rows=10, compute_dtype=torch.float64)
    (3 * loss).backward()
    grads = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = reference_cross_entropy(h, w, labels)
    (3 * ref).backward()
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(grads[0], h.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], w.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert linear_cross_entropy(h, w, labels, 10, torch.float64).item() == pytest.approx(ref.item(), rel=1e-6)
    # a frozen weight (an EAGLE head's LM head): the same loss and hidden gradient, no weight gradient;
    # the argmax hits from the same logits, with and without gradients
    h.grad = None
    correct = int(((h.detach() @ w.detach().t()).argmax(-1) == labels).sum())
    assert 0 < correct < 37 - 8
    for grad in (True, False):
        stats = {}
        with torch.set_grad_enabled(grad):
            frozen = linear_cross_entropy(h, w.detach(), labels, 10, torch.float64, stats=stats)
        assert int(stats["correct"]) == correct
        torch.testing.assert_close(frozen.double(), ref.double(), rtol=1e-6, atol=1e-5)
    (3 * linear_cross_entropy(h, w.detach(), labels, 10, torch.float64)).backward()
    torch.testing.assert_close(h.grad, grads[0], rtol=1e-5, atol=1e-5)


def test_schedule_warms_up_linearly_then_decays():
    f = [lr_factor(s, 4, 12, "linear", 0.1) for s in range(12)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[-1] == pytest.approx(0.1 + 0.9 * (1 - 7 / 8))
    assert all(a >= b for a, b in zip(f[3:], f[4:]))
    c = [lr_factor(s, 0, 10, "cosine", 0.0) for s in range(11)]
    assert c[0] == 1.0 and c[5] == pytest.approx(0.5) and c[10] == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(100, 2, 10, "constant", 0.0) == 1.0


def test_sample_order_is_a_permutation_per_epoch_and_resumable():
    order = SampleOrder(7, seed=3)
    first = order.indices(0, 14)
    assert sorted(first[:7]) == list(range(7)) and sorted(first[7:]) == list(range(7))
    assert SampleOrder(7, seed=3).indices(5, 6) == first[5:11]


def test_bench_train_smoke(tmp_path):
    from tokenforge.bench.offline import train as bench_train
    from tokenforge.cli import build_parser

    args = build_parser().parse_args(["bench", "train", "--model", "tiny-llama", "--strategy", "none",
                                      "--seq-len", "32", "--micro-batch-size", "2", "--steps", "2",
                                      "--warmup-steps", "1", "--device", "cpu", "--results-dir", str(tmp_path)])
    result = bench_train.main(args)
    figures = result["figures"]
    assert figures["correct"] and figures["tokens_per_s"] > 0 and figures["grad_accum"] == 4
    assert math.isfinite(figures["mfu"]) and list(tmp_path.glob("*-W11-none-1gpu.json"))


def test_eval_batches_give_every_rank_the_same_number_of_forwards():
    """DDP/FSDP forwards are collectives: a rank with fewer validation samples must pad, or it hangs."""
    from tokenforge.train.data import IGNORE_INDEX, eval_micro_batches

    class Three:                       # three samples of 4 tokens
        def num_samples(self, seq_len):
            return 3

        def sample(self, i, seq_len):
            ids = torch.arange(seq_len) + 10 * i
            return ids, ids + 1

    per_rank = [eval_micro_batches(Three(), 4, 1, 8, rank, 2, torch.device("cpu")) for rank in (0, 1)]
    assert [len(b) for b in per_rank] == [2, 2]
    (_, real), (_, pad) = per_rank[1]
    assert real.tolist() == [[11, 12, 13, 14]] and (pad == IGNORE_INDEX).all()
    assert all((labels != IGNORE_INDEX).all() for _, labels in per_rank[0])


def test_run_folders_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    from tests.train.conftest import remove_stale_ram_dirs

    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    dirs = {name: tmp_path / f"tokenforge-train-{name}" for name in
            (f"{gone.pid}-dead", f"{os.getpid()}-mine", "oldform-fresh", "oldform-stale")}
    for d in dirs.values():
        (d / "ckpt").mkdir(parents=True)
        (d / "ckpt" / "weights").write_bytes(b"x")
    hours_ago = time.time() - 2 * 3600
    for path in (dirs["oldform-stale"] / "ckpt" / "weights", dirs["oldform-stale"] / "ckpt", dirs["oldform-stale"]):
        os.utime(path, (hours_ago, hours_ago))
    (tmp_path / "unrelated").mkdir()
    removed = remove_stale_ram_dirs(tmp_path)
    assert sorted(removed) == sorted([dirs[f"{gone.pid}-dead"], dirs["oldform-stale"]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["unrelated", f"tokenforge-train-{os.getpid()}-mine", "tokenforge-train-oldform-fresh"])


@pytest.mark.parametrize("version", [1, 3], ids=["eagle", "eagle3"])
def test_eagle_losses_are_the_same_with_cached_and_fresh_target_features(tmp_path, version):
    """The EAGLE trainer's cached path (features and the target's argmax labels kept) and its
    uncached one (both recomputed each step) give the same losses and accuracy; EAGLE-3's features
    are the three feature layers' residual streams."""
    from tokenforge.train.config import TrainConfig
    from tokenforge.model.models.eagle import default_aux_layers
    from tokenforge.train.draft_heads import DraftHead
    from tokenforge.train.eagle import EagleLoss, EagleTrainer
    from tokenforge.train.parallel import Dist

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (12, 9, 15)]
    cfg = TrainConfig(data="-", output=str(tmp_path), model="tiny-llama", load_format="dummy", device="cpu",
                      micro_batch_size=3, seq_len=32, dtype="float32")
    got = []
    for cache in (2 << 30, 0):
        trainer = EagleTrainer(cfg, Dist(0, 1, 0, torch.device("cpu")), EagleLoss(feature_cache_bytes=cache), seqs,
                               head=DraftHead(version))
        batch = trainer._batch([0, 1, 2])
        assert bool(trainer._features) == (cache > 0)
        got.append({k: float(v.detach()) for k, v in trainer.losses(*batch).items()})
    assert got[0] == pytest.approx(got[1], rel=1e-6) and 0 < got[0]["token_loss"]
    if version == 3:       # the residual streams entering layers 2, L/2, L-3, as the drafter's AuxCapture takes them
        ids, _, feats, _ = batch
        hidden = trainer.target.config.hidden_size
        streams = {}
        hooks = [trainer.target.model.layers[i].register_forward_pre_hook(
            lambda m, a, i=i: streams.__setitem__(i, a[1] if a[2] is None else a[1] + a[2]))
            for i in range(trainer.target.config.num_hidden_layers)]
        with torch.no_grad():
            trainer.target(ids, None)
        for h in hooks:
            h.remove()
        assert trainer.head.spec.aux_layer_ids == default_aux_layers(len(streams)) and feats.shape[-1] == 3 * hidden
        for slot, layer in enumerate(trainer.head.spec.aux_layer_ids):
            torch.testing.assert_close(feats[..., slot * hidden:(slot + 1) * hidden], streams[layer].view(*ids.shape, -1))


def test_the_draft_vocabulary_is_the_most_frequent_tokens():
    """EAGLE-3's draft vocabulary: the most frequent tokens (ties to the lower id), ascending; by
    default the fewest covering 99.5% of the text in multiples of 256, capped by the vocabulary."""
    from tokenforge.train.draft_heads import DraftHead, draft_vocabulary

    seqs = [[0, 7, 7, 7, 5, 5, 9, 3], [1, 9, 7, 4]]        # first tokens (never a label) not counted
    ids, covered = draft_vocabulary(seqs, 16, 3)
    assert ids.tolist() == [5, 7, 9] and covered == pytest.approx(8 / 10)
    ids, covered = draft_vocabulary(seqs, 16, 4)
    assert ids.tolist() == [3, 5, 7, 9]                    # 3 and 4 tie once each: the lower id
    ids, covered = draft_vocabulary(seqs, 1000)
    assert len(ids) == 256 and covered == 1.0 and {3, 4, 5, 7, 9} <= set(ids.tolist())
    assert len(draft_vocabulary(seqs, 100)[0]) == 100
    many = [list(range(600)) * 2]                          # 600 tokens equally often: 597 cover 99.5%
    assert len(draft_vocabulary(many, 1000)[0]) == 768
    with pytest.raises(ValueError, match="larger than the target's 16"):
        draft_vocabulary(seqs, 16, 17)
    with pytest.raises(ValueError, match="EAGLE-3's"):
        DraftHead(version=1, draft_vocab_size=64)


@pytest.mark.parametrize("version", [1, 3], ids=["eagle", "eagle3"])
def test_eagle_training_time_test_depths_see_what_the_drafting_head_sees(tmp_path, version):
    """EagleLoss(ttt_length=3): depth d's prediction at position p equals the head run as it drafts:
    one causal sequence of the catch-up rows 0..p (the target's features; EAGLE-3's through its
    fc), then one row a depth, each fed the row before's output (EAGLE-3's pre-norm one) and the
    next token. Depth 1 alone is EAGLE's plain training (the same losses as before the unrolling,
    checked against the formula's terms)."""
    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.train.config import TrainConfig
    from tokenforge.train.draft_heads import DraftHead
    from tokenforge.train.eagle import EagleLoss, EagleTrainer
    from tokenforge.train.parallel import Dist

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (14, 11)]
    cfg = TrainConfig(data="-", output=str(tmp_path), model="tiny-llama", load_format="dummy", device="cpu",
                      micro_batch_size=2, seq_len=32, dtype="float32")
    trainer = EagleTrainer(cfg, Dist(0, 1, 0, torch.device("cpu")), EagleLoss(ttt_length=3), seqs,
                           head=DraftHead(version))
    ids, lengths, feats, argmax = trainer._batch([0, 1])
    with torch.no_grad():
        preds = trainer.predictions(ids, feats)
        assert len(preds) == 3
        for row, p in ((0, 0), (0, 6), (1, 7), (0, 10)):
            tokens, positions = ids[row, 1:p + 2], torch.arange(p + 1)
            hidden = trainer.head.combine(feats[row, :p + 1].float())
            for d in range(3):
                with set_forward_context(None):                     # one causal sequence
                    out, nxt = trainer.head(tokens, positions, hidden)
                torch.testing.assert_close(preds[d][row, p], out[-1], rtol=1e-5, atol=1e-5)
                tokens = torch.cat([tokens, ids[row, p + d + 2:p + d + 3]])
                positions = torch.cat([positions, torch.tensor([p + d + 1])])
                hidden = torch.cat([hidden, nxt[-1:]])
        # depth 0 of the unrolled run is the plain (one-depth) head
        plain = EagleTrainer(cfg, Dist(0, 1, 0, torch.device("cpu")), EagleLoss(), seqs, head=DraftHead(version))
        torch.testing.assert_close(plain.predictions(ids, feats)[0], preds[0])
    out = trainer.losses(ids, lengths, feats, argmax)
    assert {"accuracy", "accuracy_1", "accuracy_2"} <= set(out) and out["loss"].requires_grad
    out["loss"].backward()
    assert trainer.head.fc.weight.grad.abs().sum() > 0
    if version == 3:       # its own LM head learns (EAGLE's is the target's, frozen), the draft map does not
        assert trainer.head.lm_head.weight.grad.abs().sum() > 0 and out["feature_loss"] == 0


@pytest.mark.parametrize("rope", ["llama3", "yarn"])
def test_a_head_for_a_biased_long_rope_target_serves_as_it_was_trained(tmp_path, rope):
    """`head_spec` makes a plain Llama layer (no biases) with the target's rotary; the exported
    config.json states that rotary, so the head the server loads from it gives the outputs of the
    head that was trained, for EAGLE and EAGLE-3 (a gpt-oss or Qwen2 target has attention biases,
    Llama 3.1 and gpt-oss scale their rope)."""
    from types import SimpleNamespace

    from tokenforge.model.arch_config import ArchConfig, RopeScaling
    from tokenforge.model.forward_context import set_forward_context
    from tokenforge.model.loader.eagle import eagle_tensors, read_eagle_spec, save_eagle_head
    from tokenforge.model.models.eagle import EagleHead
    from tokenforge.train.draft_heads import head_spec, init_head

    own = ({"low_freq_factor": 2.0, "high_freq_factor": 8.0} if rope == "llama3" else
           {"beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.25, "truncate": False})
    scaling = RopeScaling(rope_type=rope, factor=8.0, original_max_position_embeddings=64, **own)
    target = ArchConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                        max_position_embeddings=512, attention_bias=True, o_proj_bias=True, mlp_bias=True,
                        rope_scaling=scaling)
    shared = SimpleNamespace(model=SimpleNamespace(embed_tokens=torch.nn.Embedding(512, 64)),
                             compute_logits=lambda rows: rows)
    g = torch.Generator().manual_seed(0)
    for version in (1, 3):
        spec = head_spec(target, version, 128 if version == 3 else None)
        assert not spec.arch.attention_bias and not spec.arch.mlp_bias and spec.arch.rope_scaling == scaling
        head = EagleHead(spec, torch.float32)
        init_head(head, 0)
        head.share(shared)
        out = save_eagle_head(head, tmp_path / f"v{version}")
        served = EagleHead(read_eagle_spec(out, target.num_hidden_layers), torch.float32)
        assert served.spec.arch.rope_scaling == scaling and served.spec.version == version
        served.load_weights(eagle_tensors(out))
        served.share(shared)
        ids, positions = torch.randint(0, 512, (40,), generator=g), torch.arange(200, 240)
        feats = torch.randn(40, 64 * (1 if version == 1 else 3), generator=g)
        with torch.no_grad(), set_forward_context(None):
            want, got = head(ids, positions, feats, True), served(ids, positions, feats, True)
        torch.testing.assert_close(got[0], want[0])


def test_bad_draft_head_flags_are_one_error_before_any_generation(tmp_path, capsys):
    """A draft vocabulary for an EAGLE head, or one larger than the target's vocabulary, is one
    clear error before the target generates anything (minutes on a GPU)."""
    from tokenforge.cli import main

    cases = [(["--draft-head", "eagle", "--draft-vocab-size", "64"], "only EAGLE-3's (--draft-head eagle3)"),
             (["--draft-head", "eagle3", "--draft-vocab-size", "60000"],
              "--draft-vocab-size 60000 is larger than the target's vocabulary of 49152 tokens")]
    for flags, message in cases:
        assert main(["train", *flags, "--output", str(tmp_path / "run")]) != 0
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run" / "distill").exists()
