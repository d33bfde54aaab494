"""TensorStore on a preallocated file: round trips, allocation, concurrency, errors, persistence."""

from __future__ import annotations

import os
import threading
import uuid

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memascend.io import device
from memascend.io.checkpoint import export_files
from memascend.io.errors import ChecksumError, DeviceRefusedError, StoreFullError, StoreIOError
from memascend.io.store import TensorStore
from memascend.ops import nvme_io

MiB = 1 << 20
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g, dtype=torch.int64
    ).to(dtype)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    items=st.lists(
        st.tuples(
            st.sampled_from(DTYPES),
            st.lists(st.integers(0, 50), min_size=0, max_size=3),
            st.integers(0, 2**31),
        ),
        min_size=1,
        max_size=12,
    ),
    aligned=st.booleans(),
    enable_crc=st.booleans(),
    backend=st.sampled_from(["io_uring", "libaio"]),
)
def test_round_trip_random_tensors(tmp_path_factory, items, aligned, enable_crc, backend):
    path = tmp_path_factory.mktemp("store") / "s.bin"
    tensors = {f"t{i}": random_tensor(d, tuple(s), seed) for i, (d, s, seed) in enumerate(items)}
    with TensorStore.create(
        path,
        size_bytes=32 * MiB,
        queue_depth=4,
        request_bytes=64 << 10,
        enable_crc=enable_crc,
        backend=backend,
    ) as store:
        assert store.engine.backend == backend
        for k, t in tensors.items():
            if aligned and t.nbytes:  # pinned-arena-like memory: transferred in place
                buf = nvme_io.load().aligned_empty(t.nbytes).view(t.dtype).view(t.shape)
                buf.copy_(t)
                t = buf
            rec = store.write(k, t)
            assert rec.nbytes == t.nbytes and rec.offset_bytes % 4096 == 0
            assert (rec.crc32c is not None) == (enable_crc or t.nbytes == 0)
        for k, t in tensors.items():
            out = store.read_tensor(k)
            assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
        assert store.used_bytes == sum(-(-t.nbytes // 4096) * 4096 for t in tensors.values())
    with TensorStore.open(path) as store:  # the table persisted
        assert sorted(store.keys()) == sorted(tensors)
        for k, t in tensors.items():
            assert torch.equal(store.read_tensor(k), t)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["write", "free", "read"]), st.integers(0, 7), st.integers(1, 200_000)),
        min_size=1,
        max_size=40,
    )
)
def test_interleaved_write_free_read_against_dict(tmp_path_factory, ops):
    path = tmp_path_factory.mktemp("store") / "s.bin"
    model: dict[str, torch.Tensor] = {}
    with TensorStore.create(
        path, size_bytes=2 * MiB, queue_depth=8, request_bytes=32 << 10, table_slot_bytes=64 << 10
    ) as store:
        for i, (op, k, n) in enumerate(ops):
            key = f"k{k}"
            if op == "write":
                t = random_tensor(torch.uint8, (n,), i)
                try:
                    store.write(key, t)
                    model[key] = t
                except StoreFullError as exc:
                    assert key in str(exc)
                    assert store.largest_free_bytes < -(-n // 4096) * 4096
                    if key in model:  # a failed write leaves the old contents readable
                        assert torch.equal(store.read_tensor(key), model[key])
            elif op == "free":
                if key in model:
                    store.free(key)
                    del model[key]
                else:
                    with pytest.raises(KeyError):
                        store.free(key)
            elif key in model:
                assert torch.equal(store.read_tensor(key), model[key])
            assert sorted(store.keys()) == sorted(model)
            assert store.used_bytes == sum(-(-t.nbytes // 4096) * 4096 for t in model.values())
            extents = sorted((store.record(k).offset_bytes, store.record(k).alloc_bytes) for k in model)
            for (o1, n1), (o2, _) in zip(extents, extents[1:]):
                assert o1 + n1 <= o2  # extents never overlap


def test_many_transfers_in_flight_from_threads(store_path):
    tensors = {f"w{i}": torch.randn(20_000 + 513 * i) for i in range(32)}
    errors: list[BaseException] = []
    with TensorStore.create(store_path, size_bytes=32 * MiB, queue_depth=16, request_bytes=16 << 10) as store:

        def worker(keys):
            try:
                tickets = [store.submit_write(k, tensors[k]) for k in keys]
                for t in tickets:
                    store.wait(t)
                outs = {k: torch.empty_like(tensors[k]) for k in keys}
                tickets = [store.submit_read(k, outs[k]) for k in keys]
                for t in tickets:
                    store.wait(t)
                for k in keys:
                    assert torch.equal(outs[k], tensors[k])
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(list(tensors)[j::4],)) for j in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        # several reads of one key may overlap; a write of a key with a read in flight may not
        outs = [torch.empty_like(tensors["w0"]) for _ in range(3)]
        tickets = [store.submit_read("w0", o) for o in outs]
        with pytest.raises(ValueError, match="in flight"):
            store.submit_write("w0", tensors["w1"])
        with pytest.raises(ValueError, match="in flight"):
            store.free("w0")
        store.wait_all()
        assert all(torch.equal(o, tensors["w0"]) for o in outs) and tickets


def test_overwrite_reuses_or_replaces_the_extent(store_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        first = store.write("k", torch.randn(1000))
        same = store.write("k", torch.randn(1000))
        assert same.offset_bytes == first.offset_bytes and store.used_bytes == 4096
        bigger = store.write("k", torch.randn(5000))
        assert bigger.alloc_bytes == 20480 and store.used_bytes == 20480
        store.write("k", torch.empty(0))
        assert store.used_bytes == 0 and store.read_tensor("k").numel() == 0


def test_full_store_raises_clear_error(store_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        free = store.free_bytes
        store.write("big", torch.zeros(free - 4096, dtype=torch.uint8))
        with pytest.raises(StoreFullError, match=r"full: tensor 'next' needs 8192 bytes, 4096 free"):
            store.write("next", torch.zeros(5000, dtype=torch.uint8))
        assert "next" not in store
        store.write("fits", torch.zeros(4096, dtype=torch.uint8))
        assert store.free_bytes == 0


def test_corrupted_extent_raises_checksum_error_naming_key_and_offset(store_path):
    t = torch.randn(10_000)
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        store.write("a", torch.randn(100))
        rec = store.write("layer.weight", t)
        fd = os.open(store_path, os.O_RDWR)
        try:  # flip every bit of one byte behind the store's back (writing a constant may change nothing)
            at = rec.offset_bytes + 1234
            os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
            os.fsync(fd)
        finally:
            os.close(fd)
        out = torch.empty_like(t)
        with pytest.raises(
            ChecksumError, match=rf"tensor 'layer.weight' at device offset {rec.offset_bytes} "
        ) as info:
            store.read("layer.weight", out)
        assert (info.value.key, info.value.offset_bytes) == ("layer.weight", rec.offset_bytes)
        store.enable_crc = False  # the speed-run flag skips the check
        store.read("layer.weight", out)
        assert not torch.equal(out, t)


def test_short_read_raises_io_error_naming_key_and_offset(store_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        rec = store.write("x", torch.randn(300_000))
        os.truncate(store_path, rec.offset_bytes + 8192)
        with pytest.raises(
            StoreIOError, match=rf"short read of tensor 'x' at device offset {rec.offset_bytes + 8192}"
        ) as info:
            store.read("x", torch.empty(300_000))
        assert info.value.key == "x" and info.value.errno is None
        store._closed = True  # the truncated file cannot take the table any more
        store.engine.close()


def test_refuses_foreign_store_and_signatures(store_path, tmp_path):
    owner = uuid.uuid4()
    TensorStore.create(store_path, size_bytes=8 * MiB, owner_uuid=owner).close()
    with pytest.raises(DeviceRefusedError, match="memascend store header"):
        TensorStore.create(store_path)
    TensorStore.create(store_path, owner_uuid=owner).close()  # its own old store: reused
    with pytest.raises(DeviceRefusedError, match="of owner"):
        TensorStore.open(store_path, owner_uuid=uuid.uuid4())
    TensorStore.create(store_path, allow_overwrite=True).close()
    img = tmp_path / "gpt.img"
    with open(img, "wb") as f:
        f.truncate(8 * MiB)
        f.seek(512)
        f.write(b"EFI PART")
    with pytest.raises(DeviceRefusedError, match="GPT partition table"):
        TensorStore.create(img)
    with pytest.raises(device.UserError, match="pass a size"):
        TensorStore.create(tmp_path / "new.bin")


def test_one_store_per_file(store_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB):
        with pytest.raises(DeviceRefusedError, match="locked by another store"):
            TensorStore.open(store_path)
    TensorStore.open(store_path).close()  # released on close


def test_swapping_does_not_grow_the_page_cache(store_path):
    with TensorStore.create(store_path, size_bytes=48 * MiB, request_bytes=1 * MiB) as store:
        tensors = [torch.randn(1 << 20) for _ in range(8)]  # 32 MiB
        for i, t in enumerate(tensors):
            store.write(f"t{i}", t)
        for i, t in enumerate(tensors):
            assert torch.equal(store.read_tensor(f"t{i}"), t)
        assert device.cached_bytes(store_path) == 0
    # the probe can see cache: a buffered read of the same file fills it
    with open(store_path, "rb") as f:
        f.read(8 * MiB)
    assert device.cached_bytes(store_path) >= 4 * MiB


def test_io_counters_count_device_and_payload_bytes(store_path, tmp_path):
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        start = store.io_counters()
        assert start.write_bytes == 4096 and start.read_bytes == 0  # the header written at create
        store.write("a", torch.zeros(1000))  # 4000 bytes -> one 4 KiB block on the device
        store.write("b", torch.zeros(3, 1024))  # 12288 bytes, aligned
        store.read("a", torch.empty(1000))
        d = store.io_counters() - start
        assert (d.write_bytes, d.payload_write_bytes) == (4096 + 12288, 4000 + 12288)
        assert (d.read_bytes, d.payload_read_bytes) == (4096, 4000)
        before = store.io_counters()
        export_files(store, tmp_path / "ck", chunk_bytes=4096)
        d = store.io_counters() - before
        assert d.payload_read_bytes == 4000 + 12288 and d.write_bytes == 0
        assert set(d.as_dict()) == {"read_bytes", "write_bytes", "payload_read_bytes", "payload_write_bytes"}


def test_released_reservation_of_an_existing_key_drops_its_old_tensor(store_path):
    """reserve() gives the key's old extent back; after release() the key must not point at it."""
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        store.write("a", torch.ones(2048))
        used = store.used_bytes
        res = store.reserve("a", 8192)
        store.release(res)
        assert "a" not in store and store.used_bytes == used - 8192
        store.write("z", torch.full((2048,), 7.0))  # may take the old extent of "a"
        assert torch.equal(store.read_tensor("z"), torch.full((2048,), 7.0))
        store.free("z")
        assert store.used_bytes == 0


def test_streamed_write_reserve_commit_release(store_path):
    """The public API checkpoints stream through: records(), read_extent(), reserve() ->
    write_extent() -> commit() / release()."""
    src = torch.arange(3000, dtype=torch.int32)  # 12000 bytes: three 4 KiB pieces
    data = src.numpy().tobytes()
    buf = nvme_io.load().aligned_empty(4096)
    with TensorStore.create(store_path, size_bytes=8 * MiB) as store:
        store.write("b", torch.ones(10))
        res = store.reserve("a", len(data))
        with pytest.raises(ValueError, match="in flight"):
            store.reserve("a", 16)
        assert [r.key for r in store.records()] == ["b"]  # "a" has no record until commit
        crc = 0
        for pos in range(0, len(data), 4096):
            piece = data[pos:pos + 4096]
            buf.numpy()[: len(piece)] = memoryview(piece)
            crc = nvme_io.load().crc32c(buf, len(piece), crc)
            store.write_extent(res, buf, pos, len(piece))
        rec = store.commit(res, crc32c=crc, dtype="torch.int32", shape=(3000,))
        assert rec.alloc_bytes == 12288 and rec.crc32c == crc
        assert [r.key for r in store.records()] == ["a", "b"]
        assert torch.equal(store.read_tensor("a"), src)  # the CRC32C given at commit is checked here
        out = bytearray()
        for pos in range(0, rec.nbytes, 4096):
            n = min(4096, rec.nbytes - pos)
            store.read_extent(rec, buf, pos, n)
            out += buf.numpy()[:n].tobytes()
        assert bytes(out) == data
        used = store.used_bytes
        res = store.reserve("c", 8192)
        assert store.used_bytes == used + 8192
        store.release(res)
        assert store.used_bytes == used and "c" not in store
        store.write("c", torch.zeros(4))  # no write of "c" in flight any more
