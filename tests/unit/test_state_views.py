"""ForwardContext.state_views: decodes advance their recurrent state in the cache's own slots
only where no chunk of the step reads a slot another writes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridserve.executor.torch.forward import ForwardContext, StateChunk  # noqa: E402


class SlotStorage:
    """The one method of DeviceCache that state_views reads: a layer's state of every slot."""

    def __init__(self, num_slots: int, dtype: torch.dtype = torch.float32) -> None:
        self.ssm = torch.arange(num_slots, dtype=dtype)[:, None].repeat(1, 3)

    def state_tensor(self, layer_index: int, name: str) -> torch.Tensor:
        return self.ssm


def context(storage: SlotStorage) -> ForwardContext:
    return ForwardContext(storage, layer_group=[0], attention={}, states={}, num_tokens=0)  # type: ignore[arg-type]


def decode(index: int, read: int | None, *writes: int) -> StateChunk:
    return StateChunk(index, slice(index, index + 1), read, (1,), (writes,))


def test_views_are_the_write_slots_holding_the_read_state_and_extra_slots_get_copies() -> None:
    storage = SlotStorage(10)
    ctx = context(storage)
    chunks = [decode(0, 2, 2), decode(1, 3, 5, 6), decode(2, None, 7)]
    views = ctx.state_views(0, chunks, "ssm")
    assert views is not None
    assert [v.data_ptr() for v in views] == [storage.ssm[s].data_ptr() for s in (2, 5, 7)]
    assert [v[0].item() for v in views] == [2.0, 3.0, 0.0]  # in place, copied, zeros
    for view in views:
        view.add_(100.0)
    ctx.copy_state_views(0, chunks, "ssm")
    assert storage.ssm[6].tolist() == [103.0] * 3
    assert storage.ssm[3].tolist() == [3.0] * 3  # the read slot is left as it was


@pytest.mark.parametrize(
    "chunks",
    [
        [decode(0, 2, 4), decode(1, 4, 5)],  # one writes the slot the other reads
        [decode(0, 2, 4), decode(1, 3, 4)],  # two write one slot
        [decode(0, 2, 2), decode(1, 2, 5)],  # one advances in place a slot the other reads
        [StateChunk(0, slice(0, 1), 2, (1,), ((),))],  # a decode that keeps no state
    ],
)
def test_no_views_where_writing_in_place_would_change_what_another_chunk_reads(
    chunks: list[StateChunk],
) -> None:
    storage = SlotStorage(10)
    before = storage.ssm.clone()
    assert context(storage).state_views(0, chunks, "ssm") is None
    assert torch.equal(storage.ssm, before)


def test_no_views_for_storage_that_is_not_float32() -> None:
    storage = SlotStorage(10, dtype=torch.bfloat16)
    assert context(storage).state_views(0, [decode(0, 2, 2)], "ssm") is None
