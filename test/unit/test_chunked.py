"""A sealed batch in chunks (``chunked.py``): the chunks cover the batch in
order, the backend's calls run one at a time on the caller's thread while a
pass runs on the chunk beside on a thread of ours, and a batch returns only
once none of its passes is left running."""

from __future__ import annotations

import threading
import time

import pytest

from sglang_mxfp8_hicache.chunked import (
    ChunkedCalls,
    chunk_bounds,
    growing_chunk_bounds,
)
from sglang_mxfp8_hicache.settings import Settings

SMALLEST = 4

WAIT_S = 10.0
"""How long a test waits for the other side of an overlap before failing."""


@pytest.mark.parametrize("pages", [*range(1, 40), 64, 127, 128, 256])
def test_chunks_cover_the_batch_and_shrink(pages):
    bounds = chunk_bounds(pages, SMALLEST)
    assert bounds[0][0] == 0 and bounds[-1][1] == pages
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes = [end - start for start, end in bounds]
    assert sizes == sorted(sizes, reverse=True)
    if pages < 2 * SMALLEST:
        assert sizes == [pages]
    else:
        assert min(sizes) >= SMALLEST
        assert sizes[-1] < 2 * SMALLEST
    assert chunk_bounds(pages, smallest=0) == [(0, pages)]
    growing = growing_chunk_bounds(pages, SMALLEST)
    assert [end - start for start, end in growing] == sizes[::-1]
    assert growing[0][0] == 0 and growing[-1][1] == pages
    assert all(a[1] == b[0] for a, b in zip(growing, growing[1:], strict=False))


def test_chunks_of_a_controller_batch():
    assert chunk_bounds(64, 4) == [(0, 32), (32, 48), (48, 56), (56, 60), (60, 64)]
    assert chunk_bounds(20, 4) == [(0, 10), (10, 15), (15, 20)]
    assert chunk_bounds(64, 16) == [(0, 32), (32, 48), (48, 64)]


def test_each_chunk_is_checked_while_the_next_is_read():
    """Chunk 1's read waits until chunk 0's check has begun, and chunk 0's
    check until chunk 1's read has begun: only an overlap finishes. Reads run
    in order on the caller's thread, checks on one other thread."""
    calls = ChunkedCalls("test-read", SMALLEST)
    checking, reading = threading.Event(), threading.Event()
    read_threads, check_threads, reads = set(), set(), []

    def read(start, end):
        read_threads.add(threading.get_ident())
        reads.append((start, end))
        if start == 10:
            reading.set()
            assert checking.wait(WAIT_S), (
                "chunk 0 was not checked during chunk 1's read"
            )
        return list(range(start, end))

    def check(start, end, reply):
        check_threads.add(threading.get_ident())
        assert reply == list(range(start, end))
        if start == 0:
            checking.set()
            assert reading.wait(WAIT_S), "chunk 1 was not read during chunk 0's check"
        return end - start

    good, replies = calls.read_checked(20, read, check)
    assert good == 20
    assert replies == [list(range(0, 10)), list(range(10, 15)), list(range(15, 20))]
    assert reads == [(0, 10), (10, 15), (15, 20)]
    assert read_threads == {threading.get_ident()}
    assert len(check_threads) == 1 and threading.get_ident() not in check_threads


def test_a_bad_chunk_ends_the_batch():
    """Chunk 0 has 7 good pages: the batch has 7, chunk 1, read while chunk 0
    was checked, is dropped (it wrote pages SGLang frees when the batch
    returns), and no chunk is read after it."""
    calls = ChunkedCalls("test-read", SMALLEST)
    finished = []
    started_second = threading.Event()

    def read(start, end):
        if start == 10:
            started_second.set()
            time.sleep(0.3)
        finished.append(start)
        return [True] * (end - start)

    def check(start, end, reply):
        assert started_second.wait(WAIT_S)
        return 7 if start == 0 else end - start

    good, replies = calls.read_checked(20, read, check)
    assert good == 7
    assert replies == [[True] * 10]
    time.sleep(0.05)
    assert finished == [0, 10]


def test_a_small_batch_is_one_call_on_the_callers_thread():
    calls = ChunkedCalls("test-read", SMALLEST)
    threads = []

    def read(start, end):
        threads.append(threading.get_ident())
        return [True] * (end - start)

    good, _ = calls.read_checked(5, read, lambda start, end, reply: len(reply))
    assert good == 5 and threads == [threading.get_ident()]


def test_each_chunk_is_sealed_while_the_one_before_is_written():
    """A put's chunks grow (5, 5, 10): chunk 0's write waits until chunk 1's
    seal has begun, so only an overlap finishes. Writes run in order on the
    caller's thread, each chunk sealed before it is written."""
    calls = ChunkedCalls("test-write", SMALLEST)
    sealing_second = threading.Event()
    sealed, written = [], []
    caller = threading.get_ident()

    def seal(start, end):
        sealed.append((start, end))
        if start == 5:
            sealing_second.set()

    def write(start, end):
        assert threading.get_ident() == caller
        assert (start, end) in sealed, "a chunk was written before it was sealed"
        if start == 0:
            assert sealing_second.wait(WAIT_S), "chunk 1 was not sealed during a write"
        time.sleep(0.01)
        written.append((start, end))
        return [True] * (end - start)

    replies = calls.sealed_write(20, seal, write)
    assert written == [(0, 5), (5, 10), (10, 20)] == sealed
    assert replies == [[True] * 5, [True] * 5, [True] * 10]


def test_a_write_that_raises_ends_the_batch():
    """The first chunk's write raises: the batch raises it once the next
    chunk's seal, begun beside it, is done; nothing more is written or sealed."""
    calls = ChunkedCalls("test-write", SMALLEST)
    sealed, written = [], []

    def seal(start, end):
        time.sleep(0.05)
        sealed.append(start)

    def write(start, end):
        if start == 0:
            raise ConnectionError("store unreachable")
        written.append(start)
        return True

    with pytest.raises(ConnectionError, match="store unreachable"):
        calls.sealed_write(20, seal, write)
    assert sealed == [0, 5] and written == []


def test_chunks_are_off_unless_asked():
    calls = ChunkedCalls("test-read", Settings.from_environ({}).l3_chunk_pages)
    reads = []

    def read(start, end):
        reads.append((start, end))
        return [True] * (end - start)

    assert calls.read_checked(128, read, lambda s, e, r: len(r))[0] == 128
    assert reads == [(0, 128)]
