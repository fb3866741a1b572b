from grpod.engine import Engine
from grpod.engine.data.packing import first_fit_decreasing
from tests.engine.helpers import config


def test_first_fit_decreasing() -> None:
    rows = first_fit_decreasing([5, 3, 8, 2, 4], capacity=10)
    assert rows == [[2, 3], [0, 4], [1]]


def test_position_ids_restart_per_sample() -> None:
    batch = Engine(config()).rollout()
    for m in range(batch.num_micros):
        for r in range(batch.input_ids.shape[1]):
            ids, pos = batch.sample_ids[m, r], batch.position_ids[m, r]
            for s in ids.unique().tolist():
                if s >= 0:
                    assert pos[ids == s].tolist() == list(range(int((ids == s).sum())))


def test_packed_logprobs_equal_alone() -> None:
    packed_engine = Engine(config(seq_len=64, pack=True))
    batch = packed_engine.rollout()
    alone_engine = Engine(config(seq_len=64, pack=False, micro_batch_rows=16))
    assert batch.num_micros * batch.input_ids.shape[1] < batch.num_samples  # really packed
    packed = packed_engine.score(batch)
    per_sample_packed = {}
    for s in range(batch.num_samples):
        where = (batch.sample_ids == s) & batch.loss_mask
        per_sample_packed[s] = packed[where]
    # the same samples, one per row
    from grpod.engine.data.packing import Sample, pack

    samples = []
    for s in range(batch.num_samples):
        where = batch.sample_ids == s
        tokens = batch.input_ids[where].tolist()
        n = int((batch.loss_mask & where).sum())
        samples.append(Sample(tokens, len(tokens) - n, 0.0, [0.0] * n, group=0))
    single = pack(
        samples,
        seq_len=64,
        micro_batch_rows=16,
        pack_rows=False,
        pad_token_id=0,
        rewards=batch.rewards,
        step=0,
        config_digest="x",
    )
    alone = alone_engine.score(single)
    worst = 0.0
    for s in range(batch.num_samples):
        got = alone[(single.sample_ids == s) & single.loss_mask]
        worst = max(worst, float((got - per_sample_packed[s]).abs().max()))
    assert worst <= 1e-5, worst
