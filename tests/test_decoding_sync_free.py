"""The decoder cache's reorder without a host read (heads/seq2seq.py, the CUDA path, driven on the CPU with
``whole=True``): the same cache as the CPU path's copy of the changed rows only, so beam search continues the same
hypotheses, and no syncing op on the way (tests/test_host_sync.SyncLog)."""
import torch

from tests.test_decoding import encode, model, source_batch  # noqa: F401 - the module-scoped fixture
from tests.test_host_sync import SyncLog


def test_reorder_copying_every_row_equals_copying_the_moved_rows(model):  # noqa: F811
    _, dec = model
    memory, padding, _ = encode(model, source_batch([5, 2, 8]))
    tgt = torch.randint(4, 30, (12, 5), generator=torch.Generator().manual_seed(6))
    caches = [dec.new_cache(), dec.new_cache()]
    for cache in caches:
        for t in range(5):
            dec(tgt[:, t : t + 1], memory, padding, cache)
    index = torch.tensor([0, 0, 3, 1, 5, 5, 6, 7, 11, 8, 8, 9])
    caches[0].reorder(index, whole=False)
    with SyncLog() as log:
        caches[1].reorder(index, whole=True)
    assert log.found == []
    assert torch.equal(caches[0].self_kv[..., :5, :], caches[1].self_kv[..., :5, :])
