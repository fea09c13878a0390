"""GetVectors requests as messages on one long-lived Query.VectorsSession
call (proto/shardcast/v1/shardcast.proto) instead of a call each: the
Python side of the C++ client's QuerySession (client/query_session.cc).

Any number of threads call `Session.call` at once. Each puts its request,
with an id of its own, on the queue the call's request iterator reads (gRPC's
thread for the call sends it) and waits for the reply with its id. There is
no reader thread: while replies are awaited, one of the waiting callers reads
and hands each reply to its caller; when its own arrives it passes the
reading on to another waiting caller. A thread calling alone reads its own
reply, with no thread hop on this side.

The session opens on the first call. When it breaks (the daemon restarted
or shut down, the connection dropped), each request waiting on it is sent
once more on a new one (a GetVectors can be repeated: it only reads), and
fails with that one's status if it breaks too.
"""

import queue
import threading

import grpc


class Broken(Exception):
    """The session call itself failed (not one request): `code` is the
    gRPC status code's name and `message` the details."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _Waiter:
    """One request waiting for its reply."""

    __slots__ = ("reply", "broken", "done", "signaled", "turn")

    def __init__(self):
        self.reply = None      # the SessionReply, once done
        self.broken = None     # Broken: the call ended before the reply
        self.done = False
        self.signaled = False  # `turn` released and not yet taken
        self.turn = threading.Lock()  # released: done, or this caller reads
        self.turn.acquire()


class _Call:
    """One VectorsSession call and the requests waiting on it; its fields
    are guarded by the session's lock."""

    __slots__ = ("requests", "rpc", "pending", "reader", "dead")

    def __init__(self, open_call):
        self.requests = queue.SimpleQueue()
        # The request iterator holds the queue only (not the session), so a
        # Client dropped without close() is not kept alive by gRPC's thread.
        self.rpc = open_call(iter(self.requests.get, None))
        self.pending = {}    # id -> _Waiter
        self.reader = False  # a caller is reading replies
        self.dead = False    # the call ended: no new requests on it

    def end(self):
        """Half-closes the call (its request iterator ends) and cancels it."""
        self.requests.put(None)
        self.rpc.cancel()


def _wake(waiter):
    # Under the session's lock: at most one release per acquire.
    if not waiter.signaled:
        waiter.signaled = True
        waiter.turn.release()


class Session:
    """VectorsSession calls of one channel, one open at a time.
    `open_call(request_iterator)` starts one (QueryStub.VectorsSession)."""

    def __init__(self, open_call):
        self._open_call = open_call
        self._lock = threading.Lock()
        self._current = None  # the open _Call, or None
        self._next_id = 1
        self._closed = False

    def call(self, message):
        """The daemon's SessionReply to SessionRequest `message` (its
        `vectors` filled in; its `id` is set here), whatever the reply's
        code; raises Broken when the call broke twice (or the session was
        closed). Blocking; thread-safe."""
        try:
            return self._call_once(message)
        except Broken:
            pass
        return self._call_once(message)

    def _call_once(self, message):
        mine = _Waiter()
        with self._lock:
            if self._closed:
                raise Broken("CANCELLED", "the client was closed")
            c = self._current
            if c is None or c.dead:
                c = self._current = _Call(self._open_call)
            rid = self._next_id
            self._next_id += 1
            c.pending[rid] = mine
        # A retry sets the id of a message the broken call's thread may still
        # hold: it serializes the message in one step under the GIL (or never),
        # and sends nothing on a call that has ended.
        message.id = rid
        c.requests.put(message)
        lock = self._lock
        lock.acquire()
        try:
            while not mine.done:
                if not c.reader:
                    c.reader = True
                    self._read_until_done(c, mine)
                else:
                    lock.release()
                    try:
                        mine.turn.acquire()
                    finally:
                        lock.acquire()
                    mine.signaled = False
        finally:
            if not mine.done:  # interrupted (KeyboardInterrupt): not waiting now
                c.pending.pop(rid, None)
                if c.pending and not c.reader:
                    _wake(next(iter(c.pending.values())))
            lock.release()
        if mine.broken is not None:
            raise mine.broken
        return mine.reply

    def _read_until_done(self, c, mine):
        """Reads replies on `c` and hands them out until `mine` is done or
        the call ends; entered with the lock held and c.reader set, returns
        with the lock held and c.reader cleared (another waiter, if any, was
        told to read on)."""
        lock = self._lock
        try:
            while not mine.done:
                lock.release()
                broken = None
                try:
                    reply = next(c.rpc)
                except StopIteration:
                    broken = Broken("UNAVAILABLE",
                                    "shardcastd ended the query session before answering")
                except grpc.RpcError as e:
                    code = e.code() if callable(getattr(e, "code", None)) else None
                    details = e.details() if callable(getattr(e, "details", None)) else str(e)
                    broken = Broken(code.name if code is not None else "UNKNOWN",
                                    details or "")
                except BaseException:
                    # Interrupted inside grpcio's read (KeyboardInterrupt): a
                    # read may still be pending on the call, so it is given
                    # up; the requests waiting on it go again on a new one.
                    lock.acquire()
                    self._end(c, Broken("CANCELLED", "a read of the session was interrupted"))
                    raise
                lock.acquire()
                if broken is not None:
                    self._end(c, broken)  # done for every request on c, mine too
                    break
                w = c.pending.pop(reply.id, None)
                if w is None:
                    continue  # not asked (or its caller left): ignored
                w.reply = reply
                w.done = True
                if w is not mine:
                    _wake(w)
        finally:
            c.reader = False
            if c.pending:  # someone else still waiting on c reads next
                _wake(next(iter(c.pending.values())))

    def _end(self, c, broken):
        """`c` ended (lock held): every request waiting on it is broken."""
        c.dead = True
        if self._current is c:
            self._current = None
        c.end()  # its request iterator and gRPC's thread for it end too
        for w in c.pending.values():
            w.broken = broken
            w.done = True
            _wake(w)
        c.pending.clear()

    def close(self):
        """Ends the open call: requests waiting on it fail (CANCELLED) and
        no new call is opened. Does not wait."""
        with self._lock:
            self._closed = True
            c, self._current = self._current, None
        if c is not None:
            c.end()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
