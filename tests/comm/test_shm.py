"""The shared-memory rings between ranks of one host: results, paths, memory, failures."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from freescale_comm import host_probe, shm
from freescale_comm.errors import FreescaleError
from freescale_comm.info import tensors_get_huge_pages
from freescale_comm.options import EVERY_SIZE
from tests.comm import ranks
from tests.comm.conftest import SETUP
from tests.harness import LocalGroup, reads_allowed

# Rings a rank maps per same-host peer: host bytes each way, and where CUDA is, staging rings.
_RINGS_PER_PEER = 4 if torch.cuda.is_available() else 2
# Small slots and pool: messages span several slots and the rings wrap many times.
_SMALL_RINGS = {"shm_slot_bytes": 4096, "shm_pool_bytes": 16384}


def _ring_files() -> list[str]:
    return [name for name in os.listdir("/dev/shm") if name.startswith("freescale-ring-")]


def _this_process_files() -> list[str]:
    mine = f"freescale-ring-{os.getpid()}-"
    return [name for name in _ring_files() if name.startswith(mine)]


def _in_threads(fn: Any, *per_thread_args: tuple[Any, ...]) -> None:
    """Runs ``fn`` once per argument tuple, each in a thread of its own (ranks of one
    process), and waits for them."""
    import threading

    threads = [threading.Thread(target=fn, args=args) for args in per_thread_args]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


def test_every_collective_over_the_rings_matches_gloo(fs_group):
    n = fs_group.spec.world_size
    options = {"host_path": "shm", "shm_outbox_bytes": 0, **_SMALL_RINGS}
    results = fs_group.run(ranks.ring_cases, 5, 15, 1, options, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["count"] == 15
        assert result["warnings"] == []  # no outboxes asked for: nothing slower than asked
        assert [p["peer"] for p in result["paths"]] == [p for p in range(n) if p != rank]
        for path in result["paths"]:
            assert path["path"] == "shm" and "same host" in path["why"]
            sent, received = path["ring_messages"]
            assert sent > 15 and received > 15  # every message of the group took the ring
        # Mapped while the group lives (its rings with every peer, beside the world group's),
        # already unlinked from /dev/shm, and unmapped once it is destroyed.
        assert result["during"] == {"mapped": _RINGS_PER_PEER * (n - 1), "files": 0}
        assert result["after"] == {"mapped": 0, "files": 0}


@pytest.mark.parametrize("shm_max_bytes", [-1, 1 << 19], ids=["auto", "reads"])
@pytest.mark.parametrize("threads", [1, 3])
def test_own_pieces_and_reads_on_helper_threads_match_gloo(fs_group, threads, shm_max_bytes):
    results = fs_group.run(
        ranks.own_pieces_on_helper_threads, 11, 8, threads, shm_max_bytes, timeout_s=240
    )
    for result in results:
        assert result["count"] == 8
        # Above 512 KiB the messages were read from the sender's memory, where the kernel
        # allows reads: asked for, or under auto where every rank has helpers, torch's
        # tensors get huge pages or the ranks measured the reads faster at set-up.
        measured_reads = result["why"].endswith("): the reads")
        reads_chosen = shm_max_bytes > 0 or threads > 1 or tensors_get_huge_pages()
        reads_chosen = reads_chosen or measured_reads
        assert (result["reads"] > 0) == (reads_chosen and result["readable"])
        if threads == 1:
            assert "reads peers' memory itself (host_copy_threads=1)" in result["waits"]
            assert result["helper_copy_jobs"] == 0 and result["split_reads"] == 0
        else:
            assert "reads peers' memory on 3 helper and 3 reader threads" in result["waits"]
            assert result["helper_copy_jobs"] > 0  # own pieces of 8.8 MB: 3 jobs each time
            # Reads of 8.8 MB: three parts each.
            assert (result["split_reads"] > 0) == result["readable"]
            # The own piece goes to the helpers before this thread reads a peer's message.
            orders = result["data_phase_orders"]
            assert orders and all(order[:1] == ["helpers"] for order in orders), orders
            # Meanwhile the progressing thread slept, not polled, while the helpers worked.
            assert result["yields_beside_helpers"] == [0], result


@pytest.mark.skipif(not reads_allowed(), reason="the kernel refuses reads of a peer's memory")
@pytest.mark.parametrize("threads", [1, 3])
def test_pieces_read_at_the_addresses_headers_name_match_gloo_and_take_no_ring(fs_group, threads):
    results = fs_group.run(ranks.reads_at_named_addresses, threads, timeout_s=180)
    n = len(results)
    for result in results:
        # Neither the large pieces nor their read descriptors took a ring: the addresses
        # travelled in the headers, through the outboxes (the small pieces inside them).
        before, after = result["ring_messages"]
        assert after == before, result
        # Read per call: AllToAll even 3 + 1 + 3 + 1 (in flight) calls from every peer,
        # uneven 3 + 1 from one, AllGather 3 from every peer.
        reads = (n - 1) * (3 + 1 + 3 + 1 + 3) + (3 + 1)
        assert result["reads"][1] - result["reads"][0] == reads, result
        # Read on the calling thread, in their call (those whose peers came within the poll
        # window; where ranks outnumber cores, fewer: ``yield_core``), also with reader
        # threads: a call reads at most 3 MiB (``INLINE_READ_BYTES``).
        express_before, express_after = result["express"]
        assert express_after > express_before, result


@pytest.mark.skipif(not reads_allowed(), reason="the kernel refuses reads of a peer's memory")
@pytest.mark.parametrize("enabled", [True, False], ids=["huge_pages", "off"])
def test_a_send_buffer_sent_again_is_moved_onto_huge_pages(enabled):
    # Ranks of their own: in processes shared with earlier tests, what they left at the
    # input's address (a range collapsed or refused there before, never tried again) could
    # decide the count.
    group = LocalGroup(2, backend="freescale", setup=SETUP, init_timeout_s=60)
    try:
        group.start()
        results = group.run(ranks.sends_on_huge_pages, enabled, timeout_s=120)
    finally:
        group.close()
    for result in results:
        assert result["reads"] > 0  # every message of 8 MiB was read from its sender
        if result["unsupported"]:  # a kernel older than 6.1: no MADV_COLLAPSE
            continue
        if enabled:
            if not result["collapsed"] and set(result["refusals"]) == {"ENOMEM"}:
                pytest.skip(f"the kernel found no free huge page: {result}")
            # Collapsed once, from the second call on (a step the kernel declined is tried
            # again): the 2 MiB pages inside its 16 MiB.
            assert result["collapsed"] == 1, result
            assert result["huge_kb"] >= 14 << 10, result
        else:
            assert result["collapsed"] == 0 and not result["refusals"], result
            if not tensors_get_huge_pages():
                assert result["huge_kb"] == 0, result


def test_every_collective_through_the_outboxes_matches_gloo(fs_group):
    # Boxes of 4 KiB: the headers and the data that fits go through the outboxes, larger data
    # through the rings; four collectives in flight at once make a rank wait for its peers to
    # free a box before it writes the next one.
    n = fs_group.spec.world_size
    options = {"host_path": "shm", "shm_outbox_bytes": 4096, "eager_bytes": 512, **_SMALL_RINGS}
    results = fs_group.run(ranks.ring_cases, 7, 15, 1, options, timeout_s=180)
    share = 4096 // (n - 1) - 280 - 64  # less each header (280 B) and its alignment
    for result in results:
        assert result["count"] == 15
        assert result["warnings"] == []
        for path in result["paths"]:
            assert path["headers"] == f"outboxes (CPU data up to {share} B per peer inside)"
            assert path["outbox_posts"] > 15  # every collective's headers
            sent, received = path["ring_messages"]
            assert sent > 0 and received > 0  # data too large for the box
        # Rings (with every peer) and outboxes (its own, every peer's), beside the world
        # group's; unlinked once mapped, unmapped once the group is destroyed.
        assert result["during"] == {"mapped": _RINGS_PER_PEER * (n - 1) + n, "files": 0}
        assert result["after"] == {"mapped": 0, "files": 0}


def test_a_rank_without_an_outbox_sends_every_header_through_the_rings(fs_group):
    # /dev/shm full when rank 1 makes its outbox: every rank learns it at set-up (no rank waits
    # for it) and the whole group sends its headers as ring messages, with the same results.
    n = fs_group.spec.world_size
    options = {"host_path": "shm", **_SMALL_RINGS}
    results = fs_group.run(ranks.ring_cases, 8, 10, 1, options, None, 1, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["count"] == 10
        why = "could not create an outbox in /dev/shm" if rank == 1 else "rank 1 could not create"
        assert len(result["warnings"]) == 1 and why in result["warnings"][0], result
        for path in result["paths"]:
            assert path["headers"].startswith(f"messages (no outboxes: {why}")
            assert path["outbox_posts"] == 0 and path["ring_messages"][0] > 10
        assert result["during"] == {"mapped": _RINGS_PER_PEER * (n - 1), "files": 0}
        assert result["after"] == {"mapped": 0, "files": 0}


@pytest.mark.parametrize("outbox_bytes", [0, 4096])
def test_two_hosts_intra_and_inter_host_paths_agree(fs_group4, outbox_bytes):
    # Ranks 0, 1 on one "host", 2, 3 on another: shared memory inside, UCX across, in one
    # collective; auto sends messages up to 2 KiB through the rings and larger ones through UCX.
    # Without outboxes the headers (880 B with 512 B of folded data) take the rings too; with
    # outboxes of 4 KiB the headers to the mate and data up to 2 KiB for it (shm_max_bytes, less
    # than the box's share) take the outboxes, and the headers across the hosts take UCX.
    options = {
        "host_path": "auto",
        "shm_max_bytes": 2048,
        "eager_bytes": 512,
        "shm_outbox_bytes": outbox_bytes,
        **_SMALL_RINGS,
    }
    results = fs_group4.run(ranks.ring_cases, 6, 15, 2, options, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["count"] == 15
        by_peer = {p["peer"]: p for p in result["paths"]}
        mate = rank ^ 1
        assert by_peer[mate]["path"] == "shm <= 2048 B, read from the sender's memory above"
        if outbox_bytes:
            want = "outboxes (CPU data up to 2048 B per peer inside)"
            assert by_peer[mate]["headers"] == want
            assert by_peer[mate]["outbox_posts"] > 15
        else:
            assert by_peer[mate]["headers"] == "messages (shm_outbox_bytes=0)"
            assert by_peer[mate]["ring_messages"][0] > 0
        for other in {0, 1, 2, 3} - {rank, mate}:
            assert by_peer[other]["path"] == "ucx"
            assert by_peer[other]["why"].startswith("other host (test-host-")
            assert by_peer[other]["headers"] == "messages (other host)"
            assert by_peer[other]["ring_messages"] == (0, 0)
        # The pair's rings, and the pair's outboxes (its own, its mate's).
        mapped = _RINGS_PER_PEER + (2 if outbox_bytes else 0)
        assert result["during"]["mapped"] == mapped and result["after"]["mapped"] == 0
        assert result["cpu_allgather"] == "auto"  # across hosts the ring from its threshold


def test_a_pair_without_rings_takes_ucx_and_the_others_keep_theirs(fs_group4):
    # /dev/shm full when rank 3 makes its ring from rank 1 (the file made, its memory not):
    # that pair moves host bytes by UCX, every other pair by its rings, all in one collective;
    # the half-made ring leaves no file behind.
    options = {"host_path": "shm", **_SMALL_RINGS}
    results = fs_group4.run(ranks.ring_cases, 7, 15, 1, options, {3: 1}, timeout_s=180)
    for rank, result in enumerate(results):
        assert result["count"] == 15
        for path in result["paths"]:
            if {rank, path["peer"]} == {1, 3}:
                assert path["path"] == "ucx" and path["ring_messages"] == (0, 0), path
                want = "No space left on device" if rank == 3 else "3 could not create its ring"
                assert want in path["why"], path
            else:
                assert path["path"] == "shm" and path["ring_messages"][0] > 0, path
        assert result["cpu_allgather"] == "direct"  # on one host: no ring forwarding
        # Each rank says that it is slower; the pair's ranks say why.
        warnings = result["warnings"]
        assert len(warnings) == (2 if rank in (1, 3) else 1), warnings
        assert "not through outboxes" in warnings[-1], warnings
        if rank in (1, 3):
            assert f"no shared-memory rings with rank {4 - rank}" in warnings[0], warnings
        pairs = 2 if rank in (1, 3) else 3
        assert result["during"] == {"mapped": _RINGS_PER_PEER * pairs, "files": 0}
        assert result["after"] == {"mapped": 0, "files": 0}


def test_data_sent_with_the_headers_is_dropped_after_a_bad_verdict(fs_group):
    # The world group: host_path=auto, so 128 KiB per peer takes the rings and leaves early.
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.early_data_after_a_bad_verdict, 3, timeout_s=60) == [3] * n


def test_early_data_is_not_dropped_once_the_sequence_number_wraps(fs_group):
    n = fs_group.spec.world_size
    assert fs_group.run(ranks.early_data_after_the_sequence_wraps, timeout_s=60) == ["ok"] * n


def test_a_pair_that_disagrees_on_staging_rings_leaves_no_file():
    """One rank makes CUDA staging rings, its peer (no CUDA there) does not: the pair links
    without them, and neither ring's name stays in /dev/shm."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    made: dict[int, tuple] = {}

    def rank(r: int, staging: tuple[int, int] | None) -> None:
        made[r] = shm.open_links(store, r, [1 - r], 4, 4096, 20, staging=staging)

    _in_threads(rank, (0, (2, 4096)), (1, None))
    try:
        for r in (0, 1):
            links, failures = made[r]
            assert list(links) == [1 - r] and not failures, made[r]
            assert links[1 - r].staging is None
        assert not _this_process_files()
    finally:
        for r in made:
            for link in made[r][0].values():
                shm.Hub.get().remove(link)
        for name in _this_process_files():
            os.unlink(f"/dev/shm/{name}")


class _StoreThatFails:
    """A real store whose ``set`` or ``get`` of one key raises, as a lost connection does."""

    def __init__(self, store: Any, failing_set: str = "", failing_get: str = "") -> None:
        self._store, self._set, self._get = store, failing_set, failing_get

    def set(self, key: str, value: Any) -> None:
        if key == self._set:
            raise RuntimeError("the store's connection was lost")
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        if key == self._get:
            raise RuntimeError("the store's connection was lost")
        return self._store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.parametrize("fails", ["set-ring", "get-answer", "set-outbox"])
def test_a_store_failing_during_set_up_leaves_no_file(fails):
    """The store fails while the rings or the outboxes are set up (3 ranks as threads): the
    failing rank raises, and nothing of this process stays in /dev/shm once the others'
    links are closed (a ring made before the failure, and a link already made, stayed)."""
    from datetime import timedelta

    import torch.distributed as dist

    from freescale_comm import outbox

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=20))
    failing = {
        "set-ring": _StoreThatFails(store, failing_set="freescale/shm/1to0"),
        "get-answer": _StoreThatFails(store, failing_get="freescale/shm_ok/2to0"),
        "set-outbox": _StoreThatFails(store, failing_set="freescale/box/0"),
    }[fails]
    made: dict[int, Any] = {}

    def rank(r: int) -> None:
        peers = [p for p in range(3) if p != r]
        try:
            if fails == "set-outbox":
                made[r] = outbox.open_outboxes(
                    failing if r == 0 else store, shm.Hub.get(), {}, r, 3, [0, 1, 2], 4096, 5
                )
            else:
                made[r] = shm.open_links(failing if r == 0 else store, r, peers, 4, 4096, 5)
        except Exception as err:
            made[r] = err

    _in_threads(rank, (0,), (1,), (2,))
    try:
        assert isinstance(made[0], RuntimeError), made[0]
        for r in (1, 2):  # the others finish set-up or fail waiting for rank 0, then close
            if fails == "set-outbox":
                if isinstance(made[r], tuple) and made[r][0] is not None:
                    made[r][0].close()
            elif isinstance(made[r], tuple):
                for link in made[r][0].values():
                    shm.Hub.get().remove(link)
        assert not _this_process_files()
    finally:
        for name in _this_process_files():
            os.unlink(f"/dev/shm/{name}")


def test_a_later_collectives_early_data_never_overtakes_an_earlier_ones(fs_group):
    n = fs_group.spec.world_size
    got = fs_group.run(ranks.later_data_never_overtakes_earlier, 256, 2048, timeout_s=60)
    assert got == ["ok"] * n


@pytest.mark.parametrize(
    ("mode", "torch_asks", "huge"),
    [
        ("madvise", ["1", "1"], True),
        ("madvise", ["1", "0"], False),
        ("madvise", ["0", "0"], False),
        ("always", ["0", "0"], True),
        ("never", ["1", "1"], False),
    ],
    ids=["madvise-both-ask", "madvise-one-asks", "madvise-none-asks", "always", "never"],
)
def test_the_rings_carry_every_size_unless_every_ranks_tensors_get_huge_pages(
    local_groups, mode, torch_asks, huge
):
    # Where torch's tensors get huge pages on both ranks, messages above 512 KiB are read from
    # the sender's memory (the AllToAll's 1 MiB pieces: one read per rank); else the rings
    # carry every size, even where one rank alone gets them (the probe that runs then made to
    # choose the rings).
    want = ("shm <= 524288 B, read from the sender's memory above", 1) if huge else ("shm", 0)
    got = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60).run(
        ranks.ring_limit_by_pages, mode, torch_asks, timeout_s=60
    )
    assert got == [want, want]


@pytest.mark.skipif(not reads_allowed(), reason="the kernel refuses reads of a peer's memory")
@pytest.mark.parametrize("probe_share", [None, 0.0, 1e9], ids=["measured", "rings", "reads"])
def test_with_4_kib_pages_and_no_helpers_the_ranks_measure_rings_against_reads(
    fs_group, probe_share
):
    # Every rank of the host takes the same verdict from the same figures, the collectives
    # follow it (1 MiB pieces: read where the reads won), and a second group of the same
    # processes reuses it without measuring.
    n = fs_group.spec.world_size
    results = fs_group.run(ranks.host_probe_verdicts, probe_share, timeout_s=120)
    assert len({r["why"] for r in results}) == 1
    why = results[0]["why"]
    assert why.startswith("4 KiB pages, no read helpers; measured between this host's ranks")
    figures = re.search(r"rings ([0-9.]+) ms, reads ([0-9.]+) ms\): the (reads|rings)$", why)
    assert figures is not None, why
    rings_ms, reads_ms = float(figures[1]), float(figures[2])
    assert 0 < rings_ms < 1000 and 0 < reads_ms < 1000
    reads = figures[3] == "reads"
    if probe_share is not None:
        assert reads == (probe_share > 1)
    for result in results:
        assert result["limit"] == (524288 if reads else EVERY_SIZE)
        assert result["reads_0"] == result["reads_1"] == (n - 1 if reads else 0)
        assert result["measured"] == 1


def test_the_probe_takes_each_round_at_its_slowest_rank_and_picks_the_faster_median():
    # Ranks 0 and 1, three rounds per path. Each rank's own median says the rings (2.0 and 2.0
    # against 2.1 and 2.1), but a collective waits for the slowest rank of each round: rings
    # 3.0, 3.0, 2.0 (median 3.0), reads 2.1, 2.1, 2.2 (median 2.1).
    rings = [[3.0, 2.0, 1.0], [1.0, 3.0, 2.0]]
    reads = [[2.1, 2.1, 2.2], [2.0, 2.1, 2.1]]
    verdict = host_probe.reads_win(rings, reads)
    assert verdict.reads and (verdict.rings_s, verdict.reads_s) == (3.0, 2.1)
    assert not host_probe.reads_win(reads, rings).reads
    assert not host_probe.reads_win([[1.0, 2.0]], [[2.0, 1.0]]).reads  # a tie: the rings
    verdict = host_probe.reads_win([[0.002], [0.0015]], [[0.001], [0.0012]])
    assert (verdict.rings_s, verdict.reads_s) == (0.002, 0.0012)
    assert verdict.why().endswith("(2 MiB each: rings 2.00 ms, reads 1.20 ms): the reads")
    with pytest.raises(ValueError):  # every rank has the same number of rounds
        host_probe.reads_win([[1.0, 2.0], [1.0]], [[1.0], [1.0]])


@pytest.mark.parametrize(("threads", "reads"), [([2, 2], True), ([2, 1], False)])
def test_messages_above_512_kib_are_read_where_every_rank_has_read_helpers(
    local_groups, threads, reads
):
    # 4 KiB pages on both ranks: the rings carry every size unless every rank has helper
    # threads to split its reads over (a host with cores to spare), agreed by the group (the
    # probe that runs without them made to choose the rings).
    want = ("shm <= 524288 B, read from the sender's memory above", 1) if reads else ("shm", 0)
    got = local_groups.get(2, backend="freescale", setup=SETUP, init_timeout_s=60).run(
        ranks.ring_limit_by_pages, "madvise", ["0", "0"], threads, timeout_s=60
    )
    assert got == [want, want]


def test_a_read_is_counted_done_past_a_later_collectives_early_data(fs_group):
    n = fs_group.spec.world_size
    reads = fs_group.run(ranks.read_counted_past_early_data, 2048, 300, 200, timeout_s=120)
    # Every rank read each peer's AllToAll bytes from its memory, the AllGather's none.
    assert reads == [{peer: 200 for peer in range(n) if peer != rank} for rank in range(n)]


def test_leftovers_of_a_crashed_run_are_swept():
    dead = subprocess.Popen(["true"])
    dead.wait()
    old = time.time() - 3600
    names = {
        "stale": f"freescale-ring-{dead.pid}-deadbeef0000-1to0",
        "young": f"freescale-ring-{dead.pid}-deadbeef0001-1to0",
        "alive": f"freescale-ring-{os.getpid()}-deadbeef0002-1to0",
    }
    for key, name in names.items():
        path = f"/dev/shm/{name}"
        with open(path, "wb") as f:
            f.write(b"x")
        if key != "young":
            os.utime(path, (old, old))
    try:
        removed = shm.sweep_stale()
        assert names["stale"] in removed
        assert sorted(set(_ring_files()) & set(names.values())) == sorted(
            [names["young"], names["alive"]]
        )
        # Once old enough, a dead creator's segment goes too; a live one's stays.
        shm.sweep_stale(time.time() + 3600)
        assert set(_ring_files()) & set(names.values()) == {names["alive"]}
    finally:
        for name in names.values():
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


def test_large_messages_take_ucx_one_way_where_the_kernel_refuses_reads(fs_group):
    # Rank 1 may not read its peers' memory: their messages above shm_max_bytes take UCX to
    # it, rank 1's are read by them (both sides of each direction agree), results as Gloo's.
    options = {"host_path": "auto", "shm_max_bytes": 2048, "eager_bytes": 512, **_SMALL_RINGS}
    results = fs_group.run(ranks.ring_cases, 9, 15, 1, options, None, None, 1, timeout_s=180)
    for result in results:
        assert result["count"] == 15
        for path in result["paths"]:
            if {path["rank"], path["peer"]} == {0, 1}:
                assert path["path"] == "shm <= 2048 B, read one way, ucx the other above", path
                assert "the kernel refused a read" in path["why"], path
            # Rank 1 read none of its peers' large messages; they read all of its.
            assert (path["ring_reads"] > 0) == (path["rank"] != 1), path


def test_peers_are_let_read_this_process_only_under_yamas_relational_scope(tmp_path):
    scope = tmp_path / "ptrace_scope"
    for value in ("0", "2", "3"):
        scope.write_text(f"{value}\n")
        assert not shm.allow_reads_by_peers(str(scope))
    assert not shm.allow_reads_by_peers(str(tmp_path / "absent"))  # no Yama
    scope.write_text("1\n")
    # The kernel takes the request where it has Yama (EINVAL without).
    assert shm.allow_reads_by_peers(str(scope)) == os.path.exists(shm._YAMA_SCOPE)


def test_info_says_which_path_each_pair_takes(capsys):
    from freescale_comm.cli import main
    from freescale_comm.cpu import usable_cores
    from freescale_comm.local_copies import helper_threads

    assert main(["info", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "host identity: " in out
    # The rings' limit follows the pages of torch's tensors and, in a group, whether every
    # rank has helper threads (``shm_max_bytes=-1``); the rule without a group names pages only.
    helpers = helper_threads(0, host_ranks=2, cores=usable_cores())
    if tensors_get_huge_pages():
        rule = "host bytes: peers on this host: shared-memory rings for messages <= 524288 B;"
        assert rule in out
    else:
        assert (
            "host bytes: peers on this host: shared-memory rings for messages <= 524288 B or "
            "of every size;" in out
        )
    if tensors_get_huge_pages() or helpers > 1:
        assert "rank 0 -> 1: shm <= 524288 B, " in out
    elif not reads_allowed():  # nothing to measure: the rings carry every size
        assert "rank 0 -> 1: shm  (same host; rings at every size: 4 KiB pages" in out
    else:  # as the ranks measured at set-up
        measured = "4 KiB pages, no read helpers; measured between this host's ranks at set-up"
        assert (
            f"rank 0 -> 1: shm  (same host; rings at every size: {measured}" in out
            or f"rank 0 -> 1: shm <= 524288 B, read from the sender's memory above  (same "
            f"host; host_path=auto, by size: {measured}"
            in out
        )
    assert "rank 1 -> 0: shm" in out
    # And the path of CUDA bytes: none where the ranks see no GPU (an IPC path was described).
    assert "    CUDA bytes: " in out
    if not torch.cuda.is_available():
        assert "    CUDA bytes: none: this process sees no CUDA device" in out
    # And how each rank waits for its peers (2 ranks: they outnumber the cores only on 1 core).
    poll_us = 2000 if usable_cores() < 2 else 100
    waits = f"polls for {poll_us} us, yielding its core, then sleeps"
    assert f"  rank 0, waiting for its peers: {waits} (idle_wait=auto; 2 ranks on this host" in out
    copies = (
        f"on {helpers} helper and {helpers} reader threads (a call alone in flight that reads at "
        "most 4 MiB in all: in its call)"
        if helpers > 1
        else "itself"
    )
    assert f"copies its own pieces and reads peers' memory {copies} (host_copy_threads=0)" in out


class _LateCopies:
    """Copies done at once but reported done only when ``finish`` is called (pure logic of the
    ring protocol with copy engines whose copies end after they start; the real ones are CUDA
    events, tested on the GPU machine)."""

    def __init__(self) -> None:
        self.pending: list[list[bool]] = []

    def copy_in(self, slot, request, offset, n):
        slot[:] = request.buffer[offset : offset + n]
        return self._token()

    def copy_out(self, request, offset, slot):
        request.buffer[offset : offset + len(slot)] = slot
        return self._token()

    def _token(self):
        token = [False]
        self.pending.append(token)
        return token

    @staticmethod
    def done(token):
        return token[0]

    def finish(self) -> None:
        for token in self.pending:
            token[0] = True
        self.pending = []


def _channel_pair(tmp_path, slots=3, slot_bytes=64):
    import numpy as np

    hub = shm.Hub.get()
    a_to_b = shm.Ring(str(tmp_path / "ab"), slots, slot_bytes, create=True, reserve=False)
    b_to_a = shm.Ring(str(tmp_path / "ba"), slots, slot_bytes, create=True, reserve=False)
    a = shm.Channel(hub, a_to_b, b_to_a, hub.name, device=True)
    b = shm.Channel(
        hub,
        shm.Ring(str(tmp_path / "ba"), slots, slot_bytes, create=False, reserve=False),
        shm.Ring(str(tmp_path / "ab"), slots, slot_bytes, create=False, reserve=False),
        hub.name,
        device=True,
    )
    a.copies, b.copies = _LateCopies(), _LateCopies()
    return a, b, np


def test_channel_with_late_copies_publishes_and_frees_in_slot_order(tmp_path):
    a, b, np = _channel_pair(tmp_path)
    try:
        data = np.arange(1000, dtype=np.uint8)
        early = a.send(data, tag=(7 << 16) | 1)  # 16 chunks through 3 slots
        assert not early.completed and a.busy
        # A few device chunks are queued per call (the rest by later progress calls).
        assert len(a.copies.pending) == shm.Channel.DEVICE_CHUNKS_PER_PUSH < 3
        # Nothing is published before its copy-in is done; the receive is not posted yet: the
        # published chunk stays in the ring (device bytes have nowhere else to go).
        b.progress()
        assert int(a.out.ctrl[0]) == 0
        for _ in range(2):
            a.copies.finish()
            a.progress()
        assert int(a.out.ctrl[0]) == 3
        b.progress()
        assert int(b.inc.ctrl[8]) == 0  # stalled, not freed
        out = np.zeros(1000, dtype=np.uint8)
        recv = b.recv(out, tag=(7 << 16) | 1)
        for _ in range(40):
            b.progress()
            b.copies.finish()
            b.progress()
            a.progress()
            a.copies.finish()
            a.progress()
        # A device receive is complete once its copies are queued; the ring frees its slots
        # only once they are done.
        assert recv.completed and early.completed
        assert np.array_equal(out, data)
        assert int(b.inc.ctrl[8]) == int(a.out.ctrl[0]) == 16
        assert not a.busy and not b.busy
    finally:
        a.close()
        b.close()


def test_channel_drops_a_discarded_collectives_stalled_message(tmp_path):
    a, b, np = _channel_pair(tmp_path)
    try:
        a.send(np.ones(100, dtype=np.uint8), tag=(5 << 16) | 1)
        a.copies.finish()
        a.progress()
        b.progress()
        assert int(b.inc.ctrl[8]) == 0
        b.discard(5)  # its collective failed its verdict
        for _ in range(6):
            b.progress()
            a.progress()
            a.copies.finish()
            a.progress()
        following = np.zeros(10, dtype=np.uint8)
        recv = b.recv(following, tag=(6 << 16) | 1)
        a.send(np.full(10, 3, dtype=np.uint8), tag=(6 << 16) | 1)
        for _ in range(4):
            a.copies.finish()
            a.progress()
            b.progress()
            b.copies.finish()
            b.progress()
        assert recv.completed and following.tolist() == [3] * 10
    finally:
        a.close()
        b.close()


def _host_pair(tmp_path, hub, slots=3, slot_bytes=64):
    a_to_b = shm.Ring(str(tmp_path / "ab"), slots, slot_bytes, create=True)
    b_to_a = shm.Ring(str(tmp_path / "ba"), slots, slot_bytes, create=True)
    a = shm.Channel(hub, a_to_b, b_to_a, hub.name)
    b = shm.Channel(
        hub,
        shm.Ring(str(tmp_path / "ba"), slots, slot_bytes, create=False),
        shm.Ring(str(tmp_path / "ab"), slots, slot_bytes, create=False),
        hub.name,
    )
    return a, b


def _pump(*channels, rounds=20):
    for _ in range(rounds):
        for channel in channels:
            channel.progress()


def test_host_data_waits_in_the_ring_for_its_receive_and_headers_do_not(tmp_path):
    import numpy as np

    a, b = _host_pair(tmp_path, shm.Hub.get())
    try:
        header = np.arange(10, dtype=np.uint8)
        data = np.arange(200, dtype=np.uint8)
        a.send(header, tag=7 << 16)  # sub 0: a header, received before this rank judges
        a.send(data, tag=(7 << 16) | 1)  # 4 chunks through 3 slots
        _pump(b, a)
        # The header left the ring for a buffer of its own; the data's first chunks wait in
        # the ring (one copy into the output later, no buffer of its own).
        assert int(b.inc.ctrl[8]) == 1
        got_header = np.zeros(10, dtype=np.uint8)
        assert b.recv(got_header, tag=7 << 16).completed
        out = np.zeros(200, dtype=np.uint8)
        recv = b.recv(out, tag=(7 << 16) | 1)
        _pump(b, a)
        assert recv.completed and np.array_equal(out, data)
        assert np.array_equal(got_header, header)
        assert int(b.inc.ctrl[8]) == int(a.out.ctrl[0]) == 5
    finally:
        a.close()
        b.close()


def test_unstalled_data_leaves_the_ring_for_the_header_round_behind_it(tmp_path):
    import numpy as np

    a, b = _host_pair(tmp_path, shm.Hub.get())
    try:
        data = np.arange(100, dtype=np.uint8)
        table = np.full(8, 9, dtype=np.uint8)
        a.send(data, tag=(9 << 16) | 1)  # sent early, before the verdict
        a.send(table, tag=9 << 16)  # the diagnosis round, behind it in the ring
        _pump(b, a)
        got_table = np.zeros(8, dtype=np.uint8)
        assert not b.recv(got_table, tag=9 << 16).completed  # stuck behind the data
        b.unstall(9)
        _pump(b, a)
        assert got_table.tolist() == [9] * 8
        out = np.zeros(100, dtype=np.uint8)
        assert b.recv(out, tag=(9 << 16) | 1).completed
        assert np.array_equal(out, data)
    finally:
        a.close()
        b.close()


def test_a_wake_up_byte_goes_only_to_a_peer_that_sleeps(tmp_path):
    import numpy as np

    hub = shm.Hub()
    signals = []
    hub.signal = signals.append
    a, b = _host_pair(tmp_path, hub)
    link = shm.Link(b)
    hub.add(link)
    try:
        a.send(np.ones(8, dtype=np.uint8), tag=3 << 16)
        assert signals == []  # b polls: no system call
        with hub.sleeping() as may_sleep:  # as b's epoll sleep: the ring moved meanwhile
            assert not may_sleep
        assert not int(b.inc.ctrl[shm._ASLEEP]) & 1
        with hub.sleeping() as may_sleep:
            assert may_sleep and int(b.inc.ctrl[shm._ASLEEP]) & 1
            a.send(np.ones(8, dtype=np.uint8), tag=4 << 16)
            a.send(np.ones(8, dtype=np.uint8), tag=5 << 16)
            assert signals == [hub.name]  # one byte per sleep
        assert not int(b.inc.ctrl[shm._ASLEEP]) & 1
        with hub.sleeping():  # a new sleep: a new byte
            a.send(np.ones(8, dtype=np.uint8), tag=6 << 16)
            assert signals == [hub.name] * 2
    finally:
        hub.remove(link)
        a.close()
        hub.sock.close()


class _RecordedWakes:
    """A link whose wake-ups are recorded (the outboxes' own logic is under test)."""

    def __init__(self) -> None:
        self.wakes = 0
        self.host = self

    def wake_peer(self, fenced: bool = False) -> None:
        self.wakes += 1


def test_outboxes_write_once_read_in_place_and_reuse_a_box_only_once_consumed(tmp_path):
    import numpy as np

    from freescale_comm import outbox

    n, box_bytes = 3, 1024
    size = outbox.Outboxes.segment_bytes(n, box_bytes)
    paths = [str(tmp_path / f"box{r}") for r in range(n)]
    own = [outbox.Segment(p, size, create=True) for p in paths]
    links = [{p: _RecordedWakes() for p in range(n) if p != r} for r in range(n)]
    peers = [
        {p: outbox.Segment(paths[p], size, create=False) for p in range(n) if p != r}
        for r in range(n)
    ]
    hub = shm.Hub.get()
    a, b, c = (outbox.Outboxes(hub, links[r], r, n, own[r], peers[r], box_bytes) for r in range(n))
    try:
        piece = np.arange(100, dtype=np.uint8)
        assert a.writable(1) and not a.writable(2)  # in order
        a.write(1, [(1, [piece[:8], piece]), (2, [piece])])
        assert [links[0][p].wakes for p in (1, 2)] == [1, 1]  # posted: every peer (if asleep)
        assert b.arrived(0, 1) and not b.arrived(0, 2) and b.moved() and not b.moved()
        assert np.array_equal(b.read(0, 1), np.concatenate([piece[:8], piece]))
        assert np.array_equal(c.read(0, 1), piece)
        # The same buffers for two peers are written once (an AllGather's piece).
        a.write(2, [(1, [piece]), (2, [piece])])
        words = a._boxes[0].words  # (offset, length) per peer
        assert words[2:4].tolist() == words[4:6].tolist() == [0, 100]
        assert not a.writable(3)  # box 1 still holds collective 1, unread by b and c
        assert int(own[0].ctrl[16]) == 1  # ... so a asks them to wake it when they consume
        c.release(1)
        c.release(2)
        b.release(2)  # out of order: b's count stays at 0 until 1 is released too
        assert int(own[1].ctrl[8]) == 0 and not a.writable(3)
        b.release(1)
        assert int(own[1].ctrl[8]) == 2 and links[1][0].wakes == 1  # a asked for it
        assert a.writable(3) and int(own[0].ctrl[16]) == 0
        b.release(3)
        assert links[1][0].wakes == 1  # nobody waits for it: no wake-up byte
        with pytest.raises(FreescaleError, match="exceed the box"):
            a.write(3, [(1, [np.zeros(4 * box_bytes, dtype=np.uint8)])])  # past the page too
    finally:
        for boxes in (a, b, c):
            boxes.close()


@contextlib.contextmanager
def _host_channels(tmp_path, reader_pid: int, read_threads: int = 1) -> Iterator[tuple[Any, Any]]:
    """Two host channels of this process over one pair of rings, closed on exit: ``a`` sends
    large messages by read, ``b`` reads them from process ``reader_pid`` (this one, or a dead
    one), on ``read_threads`` reader threads (1: itself)."""
    hub = shm.Hub.get()
    rings = [shm.Ring(str(tmp_path / n), 3, 64, create=True) for n in ("ab", "ba")]
    a = shm.Channel(hub, rings[0], rings[1], hub.name, peer_pid=os.getpid(), reads_out=True)
    mapped = [shm.Ring(str(tmp_path / n), 3, 64, create=False) for n in ("ba", "ab")]
    b = shm.Channel(
        hub, *mapped, hub.name, peer_pid=reader_pid, reads_in=True, read_threads=read_threads
    )
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_large_message_is_read_from_the_senders_memory_once_its_receive_is_posted(tmp_path):
    import numpy as np

    with _host_channels(tmp_path, os.getpid()) as (a, b):
        data = np.arange(100_000, dtype=np.uint32).view(np.uint8)  # far more than 3 slots
        tag = (5 << 16) | 1
        sent = a.send(data, tag, by_read=True)
        b.progress()  # no receive posted yet: the descriptor waits in the ring
        assert int(b.inc.ctrl[8]) == 0 and not sent.completed
        out = np.zeros_like(data)
        received = b.recv(out, tag)
        b.progress()  # one read, then the count of reads done
        assert received.completed and received.error is None and b.reads == 1
        assert np.array_equal(out, data) and not sent.completed  # not before it is told
        a.progress()
        assert sent.completed and sent.error is None
        assert int(a.out.ctrl[0]) == 1 and int(b.out.ctrl[0]) == 0  # one slot, no answer slot


def _progress_until(channel: Any, request: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not request.completed and time.monotonic() < deadline:
        channel.progress()
        time.sleep(0.0005)


def test_reads_on_reader_threads_run_while_the_channel_goes_on_and_wake_the_process(tmp_path):
    import select

    import numpy as np

    hub = shm.Hub.get()
    with _host_channels(tmp_path, os.getpid(), read_threads=3) as (a, b):
        data = np.arange(9 << 18, dtype=np.uint32).view(np.uint8)  # 9 MiB: two parts of 4.5
        tag = (5 << 16) | 1
        sent = a.send(data, tag, by_read=True)
        out = np.zeros_like(data)
        received = b.recv(out, tag)
        hub.drain()
        b.progress()  # starts the read on reader threads
        assert b.split_reads == 1
        assert select.select([hub.sock], [], [], 10)[0]  # a part that ended woke the process
        _progress_until(b, received)
        assert received.completed and received.error is None and b.reads == 1
        assert np.array_equal(out, data) and int(b.inc.ctrl[shm._READS_DONE]) == 1
        a.progress()
        assert sent.completed and sent.error is None


def test_reads_that_end_out_of_order_are_counted_done_in_ring_order(tmp_path, monkeypatch):
    # The sender completes its sends by the count: a later read that ended first must not
    # complete the earlier send, whose buffer the reader still reads.
    import threading

    import numpy as np

    gate = threading.Event()
    real_read = shm.read_process

    def gated_read(pid: int, local: int, remote: int, nbytes: int) -> str | None:
        if nbytes == 8192:  # the first message's read
            gate.wait(10)
        return real_read(pid, local, remote, nbytes)

    monkeypatch.setattr(shm, "read_process", gated_read)
    with _host_channels(tmp_path, os.getpid(), read_threads=2) as (a, b):
        first, second = np.full(8192, 1, dtype=np.uint8), np.full(4096, 2, dtype=np.uint8)
        sends = [
            a.send(first, (7 << 16) | 1, by_read=True),
            a.send(second, (8 << 16) | 1, by_read=True),
        ]
        outs = [np.zeros_like(first), np.zeros_like(second)]
        receives = [b.recv(outs[0], (7 << 16) | 1), b.recv(outs[1], (8 << 16) | 1)]
        deadline = time.monotonic() + 10
        while not (outs[1] == 2).all() and time.monotonic() < deadline:
            b.progress()
        assert (outs[1] == 2).all()  # the second read ended
        for _ in range(3):
            b.progress()
            a.progress()
        assert not any(r.completed for r in receives) and not any(s.completed for s in sends)
        assert int(b.inc.ctrl[shm._READS_DONE]) == 0
        gate.set()
        _progress_until(b, receives[1])
        a.progress()
        assert all(r.completed and r.error is None for r in receives)
        assert all(s.completed for s in sends) and (outs[0] == 1).all()


def test_a_discarded_collective_and_a_closed_channel_wait_for_their_reads(tmp_path, monkeypatch):
    # The caller may reuse a failed collective's buffers, or free a closed group's: no reader
    # thread may write into them afterwards. Two messages of one collective in one pass: the
    # first is read on a reader thread (slowly), the second here.
    import threading

    import numpy as np

    started, ended = threading.Event(), []
    real_read = shm.read_process

    def slow_on_reader_threads(pid: int, local: int, remote: int, nbytes: int) -> str | None:
        if threading.current_thread().name.startswith("freescale-read"):
            started.set()
            time.sleep(0.3)
        failed = real_read(pid, local, remote, nbytes)
        ended.append(nbytes)
        return failed

    monkeypatch.setattr(shm, "read_process", slow_on_reader_threads)
    with _host_channels(tmp_path, os.getpid(), read_threads=2) as (a, b):
        for prefix in (9, 10):
            for sub in (1, 2):
                a.send(np.ones(4096, dtype=np.uint8), (prefix << 16) | sub, by_read=True)
                b.recv(np.zeros(4096, dtype=np.uint8), (prefix << 16) | sub)
            started.clear()
            b.progress()
            assert started.wait(10)
            if prefix == 9:
                b.discard(9)
                assert len(ended) == 2  # both reads had ended when it returned
                assert int(b.inc.ctrl[shm._READS_DONE]) == 2  # and the sender was told
            else:
                b.close()
                assert len(ended) == 4
                b.discard(10)  # a collective that fails after its group closed the channel


def test_a_discarded_collectives_reads_not_started_yet_are_counted_but_never_read(tmp_path):
    import numpy as np

    hub = shm.Hub.get()
    with _host_channels(tmp_path, os.getpid(), read_threads=2) as (a, b):
        tag = (11 << 16) | 1
        sent = a.send(np.ones(4096, dtype=np.uint8), tag, by_read=True)
        out = np.zeros(4096, dtype=np.uint8)
        b.recv(out, tag)
        b.progress(start_reads=False)  # taken from the ring, left for the hub to start
        b.discard(11)  # (the pass failed before the hub started them)
        hub.start_reads([b])
        b.progress()
        a.progress()
        assert not out.any() and b.reads == 0
        assert int(b.inc.ctrl[shm._READS_DONE]) == 1 and sent.completed


def test_a_read_is_counted_done_past_data_that_fills_the_readers_own_ring(tmp_path):
    # The reader's ring towards the sender holds data the sender has not posted a receive for
    # (a later collective's, sent early), which stops everything behind it: the sender learns
    # of the read all the same, and only then posts that receive.
    import numpy as np

    with _host_channels(tmp_path, os.getpid()) as (a, b):
        data = np.arange(4096, dtype=np.uint8)
        first, later = (7 << 16) | 1, (8 << 16) | 1
        sent = a.send(data, first, by_read=True)
        early = np.full(3 * 64, 9, dtype=np.uint8)  # b's 3 slots
        b.send(early, later)
        a.progress()  # the early data waits in the ring for its receive
        out = np.zeros_like(data)
        b.recv(out, first)
        b.progress()
        a.progress()
        assert sent.completed and np.array_equal(out, data)
        got = np.zeros_like(early)
        received = a.recv(got, later)
        for _ in range(10):
            a.progress()
            b.progress()
        assert received.completed and np.array_equal(got, early)


def test_a_read_from_a_process_that_exited_fails_the_receive(tmp_path):
    import numpy as np

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    with _host_channels(tmp_path, child.pid) as (a, b):
        data = np.ones(4096, dtype=np.uint8)
        a.send(data, (6 << 16) | 1, by_read=True)
        received = b.recv(np.zeros_like(data), (6 << 16) | 1)
        b.progress()
        assert received.completed and "No such process" in (received.error or ""), received.error
        assert b.reads == 0


def _cached_view(tensor: torch.Tensor) -> Any:
    """A numpy view of ``tensor``'s bytes as the plan cache makes them: an address, owning
    nothing."""
    import ctypes

    import numpy as np

    size = tensor.numel() * tensor.element_size()
    return np.frombuffer((ctypes.c_uint8 * size).from_address(tensor.data_ptr()), np.uint8)


def test_a_closed_channels_unread_sends_keep_their_memory_until_read(tmp_path):
    import gc

    hub = shm.Hub.get()
    with _host_channels(tmp_path, os.getpid()) as (a, b):
        tag = (9 << 16) | 1
        tensor = torch.full((1 << 20,), 42.0)  # 4 MiB: freed memory would be unmapped
        a.send(_cached_view(tensor), tag, by_read=True).keep = tensor  # as its collective does
        del tensor
        a.close()  # a group destroyed in the middle of a collective: the peer may still read
        gc.collect()
        torch.full((1 << 20,), -7.0)  # what freed memory would be reused for
        out = torch.zeros(1 << 20)
        received = b.recv(_cached_view(out), tag)
        link = shm.Link(b)
        hub.add(link)  # a link coming checks what was lent: not read yet
        assert [entry for entry in hub._lent if entry.ring is a.out]
        time.sleep(0.15)
        hub.progress()  # reads, then finds the lent send returned
        assert received.error is None and bool((out == 42.0).all())
        assert not [entry for entry in hub._lent if entry.ring is a.out]
        hub.remove(link)


def test_lent_sends_are_returned_when_the_reader_closes_without_reading(tmp_path):
    import numpy as np

    hub = shm.Hub.get()
    with _host_channels(tmp_path, os.getpid()) as (a, b):
        a.send(np.ones(4096, dtype=np.uint8), (10 << 16) | 1, by_read=True)
        a.close()
        assert [entry for entry in hub._lent if entry.ring is a.out]
        hub.remove(shm.Link(b))  # closes b unread: it says so in the ring
        assert not [entry for entry in hub._lent if entry.ring is a.out]


def test_a_failed_collectives_receives_leave_the_ring(tmp_path):
    # A receive of a collective that failed (its caller may reuse the buffer) is dropped
    # with the collective's messages: what arrives for it later is not read into the buffer,
    # and counted done, so that the sender's later reads still complete in order.
    import numpy as np

    with _host_channels(tmp_path, os.getpid()) as (a, b):
        failed, later = (11 << 16) | 1, (12 << 16) | 1
        out = np.zeros(4096, dtype=np.uint8)
        b.recv(out, failed)
        b.discard(failed >> 16)
        first = a.send(np.ones(4096, dtype=np.uint8), failed, by_read=True)
        second = a.send(np.full(4096, 2, dtype=np.uint8), later, by_read=True)
        got = np.zeros(4096, dtype=np.uint8)
        b.recv(got, later)
        b.progress()
        a.progress()
        assert not out.any() and bool((got == 2).all()) and b.reads == 1
        assert first.completed and second.completed


def test_the_ring_control_block_words_do_not_overlap():
    # The host rings' counters and flags and the IPC path's GPU flags share each ring's first
    # page; the IPC path maps that page for the GPU.
    from freescale_comm import ipc

    words = {
        "head": [0],
        "tail": [8],
        "ipc ready": [ipc._READY],
        "ipc pushed": [ipc._PUSHED],
        "ipc done": [ipc._DONE],
        "ipc pushes done": [ipc._PUSHES_DONE],
        "ipc consumed": list(range(ipc._CONSUMED, ipc._CONSUMED + ipc.MAILBOX_SLOTS)),
        "asleep": [shm._ASLEEP],
        "reads done": [shm._READS_DONE],
        "closed": [shm._CLOSED],
    }
    flat = [word for used in words.values() for word in used]
    assert len(flat) == len(set(flat)), words
    assert max(flat) < shm._CTRL_BYTES // 8 and shm._CTRL_BYTES <= ipc._FLAG_PAGE
