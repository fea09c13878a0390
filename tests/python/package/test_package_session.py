"""Client.get_vectors over gRPC on the Client's one Query.VectorsSession call
(client/python/shardcast/_session.py): many threads at once, a request's
own error, the daemon restarting, close(); and the session's machinery
against a stand-in call (replies out of order, a call breaking, closing).

Expected vectors come from numpy reads of the dataset files
(package_fixtures.Reference), never from the package or the daemon.
"""

import queue
import re
import threading
import time

import grpc
import numpy as np
import pytest

from package_fixtures import (datasets, package_logs, ref, sockdir,  # noqa: F401
                              start_daemon, wait_for)

import shardcast
from shardcast import _session
from shardcast.v1 import shardcast_pb2 as pb

SESSION_FROM = shardcast._client.SESSION_FROM


def _http_port(d):
    """The port of the daemon's --http 127.0.0.1:0 endpoint, from its log."""
    return int(re.search(r"HTTP admin on 127\.0\.0\.1:(\d+)", d.log.read_text()).group(1))


def _calls(d, method):
    """How many `method` calls the daemon's (debug) log shows."""
    return len(re.findall(r"DEBUG call /shardcast\.v1\.Query/%s peer=" % method,
                          d.log.read_text()))


def _coords(r, rng, n):
    return [(int(rng.integers(r.N)), r.layers[int(rng.integers(r.L))],
             int(rng.integers(r.T))) for _ in range(n)]


def _want(r, coords):
    return np.stack([r.vector(*c) for c in coords])


def _run_threads(targets):
    """Runs the callables in threads started together; their exceptions."""
    errors = []
    barrier = threading.Barrier(len(targets))

    def run(fn):
        try:
            barrier.wait(timeout=10)
            fn()
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            errors.append(e)
    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting"
    return errors


# ---------------------------------------------------------------------------
# Against shardcastd.

def test_threads_of_one_client_share_one_session_and_get_numpys_vectors(
        start_daemon, datasets):
    """8 threads of one Client (local_queries=False) ask at once for vectors
    of two datasets, SESSION_FROM to SESSION_FROM + 40 per call: every reply
    equals numpy, and all of them went as messages on one VectorsSession
    call (no unary GetVectors, no StreamVectors); closing the Client ends it
    and leaves no thread that would keep the interpreter alive."""
    from sysprobe import metric_samples
    d = start_daemon("--http", "127.0.0.1:0")
    port = _http_port(d)
    before = set(threading.enumerate())
    per_thread = 12
    client = shardcast.Client(d.address, local_queries=False)
    wrong = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        for i in range(per_thread):
            r = (datasets.main, datasets.v1)[i % 2]
            coords = _coords(r, rng, SESSION_FROM + int(rng.integers(41)))
            got = client.get_vectors(r.id, coords)
            if got.dtype != np.float32 or got.shape != (len(coords), r.D) or \
                    not np.array_equal(got.view(np.uint32), _want(r, coords).view(np.uint32)):
                wrong.append((seed, i))

    errors = _run_threads([lambda s=s: worker(s) for s in range(8)])
    assert not errors, errors[:3]
    assert not wrong, wrong[:5]
    m = metric_samples(port)
    assert m["shardcast_session_requests_total"] == 8 * per_thread
    assert m["shardcast_query_sessions"] == 1
    assert m["shardcast_queries_streamed_total"] == 0
    assert _calls(d, "VectorsSession") == 1, d.describe()
    assert _calls(d, "GetVectors") == 0 and _calls(d, "StreamVectors") == 0
    client.close()
    wait_for(lambda: metric_samples(port)["shardcast_query_sessions"] == 0,
             what="the session ended after close()")
    left = [t for t in set(threading.enumerate()) - before if not t.daemon]
    assert not left, left


def test_a_bad_coordinate_fails_its_own_request_only(start_daemon, datasets):
    """While 6 threads get vectors on the session, a seventh asks again and
    again for vectors one of which is outside the dataset: each of its
    requests raises shardcast.Error OUT_OF_RANGE naming the coordinate, and
    every other request gets numpy's vectors, all on one VectorsSession call.
    Below SESSION_FROM coordinates (a unary call) the error is the same."""
    d = start_daemon()
    r = datasets.main
    rng = np.random.default_rng(3)
    bad = _coords(r, rng, SESSION_FROM + 10)
    bad[70] = (r.N, r.layers[0], 0)
    refused, wrong = [], []
    with shardcast.Client(d.address, local_queries=False) as client:
        def good(seed):
            g = np.random.default_rng(seed)
            for _ in range(15):
                coords = _coords(r, g, SESSION_FROM + int(g.integers(20)))
                got = client.get_vectors(r.id, coords)
                if not np.array_equal(got, _want(r, coords)):
                    wrong.append(seed)

        def asks_badly():
            for _ in range(15):
                with pytest.raises(shardcast.Error) as e:
                    client.get_vectors(r.id, bad)
                refused.append((e.value.code, e.value.message))

        errors = _run_threads([lambda s=s: good(s) for s in range(6)] + [asks_badly])
        assert not errors, errors[:3]
        assert not wrong, wrong
        assert len(refused) == 15
        for code, message in refused:
            assert code == "OUT_OF_RANGE" and "coordinates[70]" in message, (code, message)
        assert _calls(d, "VectorsSession") == 1, d.describe()
        # The session serves on, and a unary call refuses the same way.
        ref.assert_f32_equal(client.get_vectors(r.id, bad[:70]), _want(r, bad[:70]), "after")
        assert len(bad[60:]) < SESSION_FROM
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors(r.id, bad[60:])
        assert e.value.code == "OUT_OF_RANGE" and "coordinates[10]" in e.value.message
        assert _calls(d, "VectorsSession") == 1 and _calls(d, "GetVectors") == 1


def test_get_vectors_reopens_the_session_after_the_daemon_restarts(start_daemon, datasets):
    """The daemon restarts under an open session: the next get_vectors is
    answered (its request goes again on a new session), with numpy's vectors.
    While the daemon is down get_vectors raises shardcast.Error UNAVAILABLE
    (it does not hang), and once it is back get_vectors works again."""
    d = start_daemon()
    r = datasets.main
    rng = np.random.default_rng(8)
    coords = _coords(r, rng, SESSION_FROM + 3)
    want = _want(r, coords)
    with shardcast.Client(d.address, local_queries=False) as client:
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "first daemon")
        assert d.stop() == 0
        d.start().wait_ready()
        ref.assert_f32_equal(client.get_vectors(r.id, coords), want, "after a restart")
        assert _calls(d, "VectorsSession") == 1, d.describe()
        # A request while the daemon is down, and after it is back.
        assert d.stop() == 0
        t = time.monotonic()
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors(r.id, coords)
        assert e.value.code == "UNAVAILABLE", e.value
        assert time.monotonic() - t < 10
        d.start().wait_ready()

        def answered():
            try:
                return [client.get_vectors(r.id, coords)]
            except shardcast.Error as e:
                # The channel may wait out its reconnection backoff first.
                assert e.code == "UNAVAILABLE", e
                return None
        got, = wait_for(answered, what="get_vectors after the restart")
        ref.assert_f32_equal(got, want, "after the second restart")
        errors = _run_threads([lambda: ref.assert_f32_equal(
            client.get_vectors(r.id, coords), want, "threads")] * 4)
        assert not errors, errors


def test_a_broken_session_reply_is_data_loss_and_a_refused_one_names_its_code(
        start_daemon, datasets):
    """A session reply whose shape or data do not fit the request raises
    shardcast.Error DATA_LOSS (never a wrong array); a reply with a code
    raises that code's name with the reply's message."""
    d = start_daemon()
    r = datasets.main
    coords = [(0, r.layers[0], 0)] * SESSION_FROM

    class Replies:
        def __init__(self, reply):
            self.reply = reply

        def call(self, message):
            assert len(message.vectors.coordinates) == SESSION_FROM
            return self.reply

        def close(self):
            pass

    n, data = SESSION_FROM, bytes(SESSION_FROM * r.D * 4)
    with shardcast.Client(d.address, local_queries=False) as client:
        client._session.close()
        cases = {
            "rows": pb.SessionReply(shape=[n + 1, r.D], data=data + bytes(r.D * 4)),
            "1-d": pb.SessionReply(shape=[n * r.D], data=data),
            "bytes": pb.SessionReply(shape=[n, r.D], data=data[:-4]),
            "no data": pb.SessionReply(shape=[n, r.D]),
        }
        for name, reply in cases.items():
            client._session = Replies(reply)
            with pytest.raises(shardcast.Error) as e:
                client.get_vectors(r.id, coords)
            assert e.value.code == "DATA_LOSS", (name, e.value)
        client._session = Replies(pb.SessionReply(code=grpc.StatusCode.NOT_FOUND.value[0],
                                                  message="no such dataset"))
        with pytest.raises(shardcast.Error) as e:
            client.get_vectors(r.id, coords)
        assert (e.value.code, e.value.message) == ("NOT_FOUND", "no such dataset")
        client._session = Replies(pb.SessionReply(shape=[n, r.D], data=data))
        got = client.get_vectors(r.id, coords)
        assert got.shape == (n, r.D) and got.dtype == np.float32 and not got.any()


# ---------------------------------------------------------------------------
# The session's machinery against a stand-in for the call.

class FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


class FakeCall:
    """One VectorsSession call: `received` gets each request message gRPC's
    thread would send (then None when the request iterator ends); the test
    puts replies (or an exception to raise, or None to end the call) on
    `replies`."""

    def __init__(self, requests):
        self.received = queue.SimpleQueue()
        self.replies = queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.half_closed = threading.Event()
        threading.Thread(target=self._send, args=(requests,), daemon=True).start()

    def _send(self, requests):
        for m in requests:
            copy = pb.SessionRequest()
            copy.CopyFrom(m)
            self.received.put(copy)
        self.half_closed.set()

    def __next__(self):
        got = self.replies.get(timeout=30)
        if got is None:
            raise StopIteration
        if isinstance(got, BaseException):
            raise got
        return got

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.replies.put(FakeRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled"))

    def take(self, n):
        return [self.received.get(timeout=10) for _ in range(n)]


class FakeDaemon:
    def __init__(self):
        self.calls = []

    def open(self, requests):
        call = FakeCall(requests)
        self.calls.append(call)
        return call


def _message(tag):
    m = pb.SessionRequest()
    m.vectors.dataset = tag
    return m


def _answer(request):
    """A reply that says which request it answers (its dataset as message)."""
    return pb.SessionReply(id=request.id, message=request.vectors.dataset)


def _callers(session, tags):
    """Threads calling session.call for each tag; (threads, results dict)."""
    results = {}

    def run(tag):
        try:
            results[tag] = session.call(_message(tag)).message
        except BaseException as e:  # noqa: BLE001 - checked by the test
            results[tag] = e
    threads = [threading.Thread(target=run, args=(tag,), daemon=True) for tag in tags]
    for t in threads:
        t.start()
    return threads, results


def _join(threads):
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a caller is still waiting"


def test_replies_in_any_order_reach_their_callers():
    """Requests of many threads on one call, each with an id of its own,
    answered in the reverse order: each caller gets its own reply; a reply
    with an id nobody waits for is ignored; a thread calling alone after
    them reads its own reply on the same call."""
    fake = FakeDaemon()
    session = _session.Session(fake.open)
    tags = [f"t{i}" for i in range(12)]
    threads, results = _callers(session, tags)
    wait_for(lambda: fake.calls, what="the call opened")
    call = fake.calls[0]
    requests = call.take(len(tags))
    assert len({q.id for q in requests}) == len(tags), "ids are not unique"
    call.replies.put(pb.SessionReply(id=10 ** 9, message="nobody's"))
    for q in reversed(requests):
        call.replies.put(_answer(q))
    _join(threads)
    assert results == {tag: tag for tag in tags}
    threads, results = _callers(session, ["alone"])
    q, = call.take(1)
    call.replies.put(_answer(q))
    _join(threads)
    assert results == {"alone": "alone"}
    assert len(fake.calls) == 1 and not call.cancelled.is_set()


@pytest.mark.parametrize("how", ["error", "end"])
def test_a_broken_call_sends_each_waiting_request_once_more(how):
    """The call breaks (an RpcError, or the stream ends) with requests
    waiting: each is sent once more, with a new id, on a new call and gets
    that call's reply; when that call breaks too, each raises Broken with
    its status (UNAVAILABLE for a stream that just ended)."""
    fake = FakeDaemon()
    session = _session.Session(fake.open)

    def brk(call):
        call.replies.put(FakeRpcError(grpc.StatusCode.UNAVAILABLE, "Socket closed")
                         if how == "error" else None)

    threads, results = _callers(session, ["a", "b", "c"])
    wait_for(lambda: fake.calls, what="the first call")
    first = fake.calls[0].take(3)
    brk(fake.calls[0])
    wait_for(lambda: len(fake.calls) == 2, what="a second call")
    second = fake.calls[1].take(3)
    assert {q.vectors.dataset for q in second} == {"a", "b", "c"}
    assert not {q.id for q in second} & {q.id for q in first}, "an id used again"
    assert fake.calls[0].cancelled.is_set() and \
        fake.calls[0].half_closed.wait(10), "the broken call was not ended"
    for q in second:
        fake.calls[1].replies.put(_answer(q))
    _join(threads)
    assert results == {"a": "a", "b": "b", "c": "c"}

    threads, results = _callers(session, ["d", "e"])
    fake.calls[1].take(2)
    brk(fake.calls[1])
    wait_for(lambda: len(fake.calls) == 3, what="a third call")
    fake.calls[2].take(2)
    brk(fake.calls[2])
    _join(threads)
    for tag in ("d", "e"):
        assert isinstance(results[tag], _session.Broken), results
        assert results[tag].code == "UNAVAILABLE", results[tag]
    assert len(fake.calls) == 3
    # And the next request opens a fourth.
    threads, results = _callers(session, ["f"])
    wait_for(lambda: len(fake.calls) == 4, what="a fourth call")
    q, = fake.calls[3].take(1)
    fake.calls[3].replies.put(_answer(q))
    _join(threads)
    assert results == {"f": "f"}


def test_close_ends_the_call_and_fails_its_waiting_requests():
    """close() with requests waiting: the call's request iterator ends and
    the call is cancelled; the waiting requests raise Broken CANCELLED at
    once (no new call is opened), and so does every later one."""
    fake = FakeDaemon()
    session = _session.Session(fake.open)
    threads, results = _callers(session, ["a", "b"])
    wait_for(lambda: fake.calls, what="the call opened")
    fake.calls[0].take(2)
    t = time.monotonic()
    session.close()
    _join(threads)
    assert time.monotonic() - t < 5
    assert fake.calls[0].cancelled.is_set() and fake.calls[0].half_closed.wait(10)
    for tag in ("a", "b"):
        assert isinstance(results[tag], _session.Broken) and results[tag].code == "CANCELLED"
    with pytest.raises(_session.Broken) as e:
        session.call(_message("late"))
    assert e.value.code == "CANCELLED"
    assert len(fake.calls) == 1


def test_an_interrupted_read_gives_the_call_up():
    """A KeyboardInterrupt inside the read of a waiting caller reaches that
    caller; the call (whose read may still be pending in grpcio) is given up,
    and the other request waiting on it goes again on a new call."""
    fake = FakeDaemon()
    session = _session.Session(fake.open)
    threads, results = _callers(session, ["a", "b"])
    wait_for(lambda: fake.calls, what="the call opened")
    fake.calls[0].take(2)
    fake.calls[0].replies.put(KeyboardInterrupt())
    wait_for(lambda: len(fake.calls) == 2, what="a second call")
    q, = fake.calls[1].take(1)
    fake.calls[1].replies.put(_answer(q))
    _join(threads)
    interrupted = [t for t, v in results.items() if isinstance(v, KeyboardInterrupt)]
    assert len(interrupted) == 1, results
    other = ({"a", "b"} - set(interrupted)).pop()
    assert results[other] == other and q.vectors.dataset == other
    assert fake.calls[0].cancelled.is_set()
