"""A fault-injecting TCP proxy on loopback for tests: put it between a store client and the
local S3 server and make the network misbehave, for real (the client's own sockets see it).

    async with FaultyProxy(server_port, faults=Faults(reset_response=0.02), seed=7) as proxy:
        url = f"s3://bucket/prefix?endpoint={proxy.endpoint}"
        ...
        proxy.set_down()   # a full outage: every connection dropped, new ones refused
        proxy.set_up()

Faults, each counted by kind in `faults_injected`:
- `drop`: a new connection is accepted and closed at once (as is every one while `down`, which
  counts as part of that outage);
- `delay`: a request is held for a while before it is forwarded;
- `reset_request`: the connection is cut after part of a request went to the server;
- `reset_response`: the request goes through, the connection is cut part-way into the answer
  (for a write: it landed, but the client never hears so);
- `503`: the request is answered `503 SlowDown` without reaching the server (always while
  `busy`: a burst);
- `outage` and `burst`: counted once per `set_down()` / `set_busy(True)`.

The client-to-server stream is read as HTTP/1.1 requests (head, then `Content-Length` bytes of
body), so faults and `hold`s apply to one request each; a request with another framing (chunked)
passes through untouched, with everything after it on that connection. Answers are copied
byte for byte. Every random choice comes from `seed`.

`hold(match)` arms a one-shot trap: the next request for which `match(method, path)` is true is
stopped before it is forwarded and `Hold.hit` is set; it goes on at `Hold.release()`, is cut at
`Hold.drop()`, or reaches the server with its answer cut at `Hold.lose_answer()`. A test kills a
process at that exact moment (its pointer write in flight, say) and decides whether it lands.
Interim answers (`100 Continue`) always pass, so a cut answer means the request was whole.

`trickle(match, every_s, times=1)`: the answers of the next `times` requests `match` accepts
reach the client one byte every `every_s` seconds (the rest of that connection's answers too),
as a stuck or overloaded server would send them: no read timeout ever trips, only an overall
deadline (the store's, or its caller's) ends the request. `Trickle.hits` counts the requests
trickled, and `faults_injected["trickle"]` too.

`strip_etag(match, times=1)`: the next `times` answers to requests `match` accepts lose their
`ETag` header (a broken gateway's 200 without one); counted in `faults_injected["strip_etag"]`.

`swallow_put(match, times=1)`: the next `times` PUTs `match` accepts are answered `200 OK` (with
the ETag S3 would give: the body's quoted MD5) by the proxy and never forwarded: a write
acknowledged but not stored. `Trickle.hits` and `faults_injected["swallow_put"]` count them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"
MAX_HEAD_BYTES = 64 * 1024
SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate (injected).</Message></Error>"
)


@dataclass(frozen=True, kw_only=True)
class Faults:
    """Per-request (per-connection for `drop`) chances of each fault; all 0: a plain proxy."""

    drop: float = 0.0  # a new connection is closed at once
    delay: float = 0.0  # a request waits `delay_s` (uniform) before it is forwarded
    delay_s: tuple[float, float] = (0.05, 0.5)
    reset_request: float = 0.0  # cut mid-request
    reset_response: float = 0.0  # cut mid-answer
    status_503: float = 0.0  # answered 503 SlowDown by the proxy

    def __post_init__(self) -> None:
        for name in ("drop", "delay", "reset_request", "reset_response", "status_503"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"Faults.{name} must be a probability, got {getattr(self, name)}")
        low, high = self.delay_s
        if not 0 <= low <= high:
            raise ValueError(f"Faults.delay_s must be (low, high) with 0 <= low <= high, got {self.delay_s}")


NO_FAULTS = Faults()


@dataclass
class Hold:
    """A one-shot trap set by `FaultyProxy.hold` (see the module doc)."""

    match: Callable[[str, str], bool]
    hit: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the request went on (whole) or was cut
    request: tuple[str, str] | None = None  # (method, path) of the request it stopped

    cut: bool = False
    lose_answer_flag: bool = False
    then_down: bool = False

    def release(self) -> None:
        """Let the request go on to the server."""
        self.go.set()

    def drop(self) -> None:
        """Cut the request's connection instead: it never reaches the server."""
        self.cut = True
        self.go.set()

    def lose_answer(self, *, then_down: bool = False) -> None:
        """Let the request reach the server, but cut its answer before the first byte; with
        `then_down`, the proxy goes down at that instant (`set_down`), so no retry gets through
        until `set_up()`: the caller cannot learn that its write landed."""
        self.lose_answer_flag = True
        self.then_down = then_down
        self.go.set()


@dataclass
class Trickle:
    """Requests whose answers are trickled (`FaultyProxy.trickle`, see the module doc)."""

    match: Callable[[str, str], bool]
    every_s: float
    times: int
    hits: int = 0


@dataclass
class _Request:
    method: str
    path: str
    head: bytes
    body_length: int | None  # None: framing we do not follow (chunked): pass the rest through
    expects_continue: bool


@dataclass
class _AnswerCut:
    """How much more of the answers on one connection may pass (None: all), then what."""

    limit: int | None = None
    then_down: bool = False
    trickle_s: float | None = None  # send one byte per this many seconds (None: at full speed)
    strip_etag: int = 0  # answers still to pass without their ETag header


class _Cut(Exception):
    """This connection is cut on purpose."""


class FaultyProxy:
    """A TCP proxy on loopback in front of `port` (see the module doc). While `down` it drops
    every connection, the open ones at once and new ones as soon as they arrive."""

    def __init__(self, port: int, *, faults: Faults = NO_FAULTS, seed: int = 0, name: str = "") -> None:
        self.target = port
        self.faults = faults
        self.name = name
        self.rng = random.Random(seed)
        self.down = False
        self.busy = False
        self.dropped = 0
        self.forwarded = 0
        self.faults_injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()  # requests forwarded, by method
        self._holds: list[Hold] = []
        self._trickles: list[Trickle] = []
        self._strips: list[Trickle] = []
        self._swallows: list[Trickle] = []
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> FaultyProxy:
        self._server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.set_down(count=False)
        for hold in self._holds:
            hold.release()
        await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # -- switches -------------------------------------------------------------------------------
    def set_down(self, *, count: bool = True) -> None:
        """A full outage: cut every open connection, refuse new ones until `set_up()`."""
        if count and not self.down:
            self.faults_injected["outage"] += 1
        self.down = True
        for writer in list(self._open):
            writer.transport.abort()

    def set_up(self) -> None:
        self.down = False

    def set_busy(self, busy: bool) -> None:
        """A 503 burst: while busy, every request is answered `503 SlowDown`."""
        if busy and not self.busy:
            self.faults_injected["burst"] += 1
        self.busy = busy

    def hold(self, match: Callable[[str, str], bool]) -> Hold:
        """Arm a one-shot trap for the next request `match(method, path)` accepts."""
        trap = Hold(match)
        self._holds.append(trap)
        return trap

    def trickle(self, match: Callable[[str, str], bool], every_s: float, *, times: int = 1) -> Trickle:
        """Trickle the answers of the next `times` requests `match(method, path)` accepts."""
        if not every_s > 0 or times < 1:
            raise ValueError(f"trickle needs every_s > 0 and times >= 1, got {every_s}, {times}")
        trap = Trickle(match, every_s, times)
        self._trickles.append(trap)
        return trap

    def strip_etag(self, match: Callable[[str, str], bool], *, times: int = 1) -> Trickle:
        """Strip the ETag header of the answers to the next `times` requests `match` accepts."""
        trap = Trickle(match, 0.0, times)
        self._strips.append(trap)
        return trap

    def swallow_put(self, match: Callable[[str, str], bool], *, times: int = 1) -> Trickle:
        """Answer the next `times` PUTs `match(method, path)` accepts with 200, never forwarded."""
        trap = Trickle(match, 0.0, times)
        self._swallows.append(trap)
        return trap

    def _trickled(self, request: _Request) -> Trickle | None:
        """The armed trickle this request sets off (counted), if any."""
        trap = next((t for t in self._trickles if t.hits < t.times and t.match(request.method, request.path)), None)
        if trap is not None:
            trap.hits += 1
            self.faults_injected["trickle"] += 1
        return trap

    # -- connections ----------------------------------------------------------------------------
    def _chance(self, p: float) -> bool:
        return p > 0 and self.rng.random() < p

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._connection(reader, writer)
        finally:
            self._tasks.discard(task)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down or self._chance(self.faults.drop):
            self.dropped += 1
            if not self.down:
                self.faults_injected["drop"] += 1
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(LOOPBACK, self.target)
        except OSError:
            writer.transport.abort()
            return
        self.forwarded += 1
        pair = {writer, up_writer}
        self._open |= pair
        cut = _AnswerCut()
        pipes = [
            asyncio.ensure_future(self._requests(reader, up_writer, writer, cut)),
            asyncio.ensure_future(self._answers(up_reader, writer, cut)),
        ]
        try:
            await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._open -= pair
            for w in pair:
                w.transport.abort()
            for p in pipes:
                p.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)

    async def _answers(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, cut: _AnswerCut) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while (data := await src.read(1 << 16)) and not self.down:
                if cut.strip_etag and data.startswith(b"HTTP/1.1 2"):  # the head is in the first read
                    cut.strip_etag -= 1
                    data = re.sub(rb"\r\n[Ee][Tt][Aa][Gg]:[^\r]*", b"", data, count=1)
                limit = cut.limit
                if limit is not None and data.startswith(b"HTTP/1.1 1") and (end := data.find(b"\r\n\r\n")) >= 0:
                    dst.write(data[: end + 4])  # an interim answer (100 Continue) always passes: the
                    await dst.drain()  # cut falls in the final answer, after the body was sent
                    data = data[end + 4 :]
                    if not data:
                        continue
                if limit is not None and len(data) >= limit:
                    dst.write(data[:limit])
                    await dst.drain()
                    if cut.then_down:
                        self.set_down()
                    return  # cut part-way into the answer
                if limit is not None:
                    cut.limit = limit - len(data)
                if cut.trickle_s is not None:
                    for i in range(len(data)):
                        await asyncio.sleep(cut.trickle_s)
                        if self.down:
                            return
                        dst.write(data[i : i + 1])
                        await dst.drain()
                    continue
                dst.write(data)
                await dst.drain()

    async def _requests(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        cut: _AnswerCut,
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError, _Cut, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            while not self.down:
                request = await _read_head(src)
                if request is None:
                    return
                if request.body_length is None:  # framing we do not follow: no faults from here on
                    dst.write(request.head)
                    await _copy_rest(src, dst, lambda: self.down)
                    return
                await self._one_request(request, src, dst, client, cut)

    async def _one_request(
        self,
        request: _Request,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        cut: _AnswerCut,
    ) -> None:
        trap = next((t for t in self._holds if t.match(request.method, request.path)), None)
        if trap is None:
            await self._forward(request, src, dst, client, cut)
            return
        self._holds.remove(trap)
        trap.request = (request.method, request.path)
        trap.hit.set()
        try:
            await trap.go.wait()
            if trap.cut:
                raise _Cut
            if trap.lose_answer_flag:
                cut.limit, cut.then_down = 0, trap.then_down
            await self._forward(request, src, dst, client, cut)
        finally:
            trap.done.set()

    async def _forward(
        self,
        request: _Request,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
        cut: _AnswerCut,
    ) -> None:
        """Forward one request, or inject a fault into it."""
        f = self.faults
        if self.down:
            raise _Cut
        if self.busy or self._chance(f.status_503):
            self.faults_injected["503"] += 1
            await self._answer_503(request, src, client)
            raise _Cut
        swallow = next((t for t in self._swallows if t.hits < t.times and request.method == "PUT"
                        and t.match(request.method, request.path)), None)
        if swallow is not None:
            swallow.hits += 1
            self.faults_injected["swallow_put"] += 1
            await self._answer_swallowed(request, src, client)
            return
        if self._chance(f.delay):
            self.faults_injected["delay"] += 1
            await asyncio.sleep(self.rng.uniform(*f.delay_s))
        assert request.body_length is not None
        if self._chance(f.reset_request):
            self.faults_injected["reset_request"] += 1
            total = len(request.head) + request.body_length
            sent = self.rng.randrange(1, total) if total > 1 else 0
            part = request.head[:sent]
            dst.write(part)
            await dst.drain()
            if sent > len(request.head) and not request.expects_continue:
                await _copy_exact(src, dst, sent - len(request.head))
            raise _Cut
        if self._chance(f.reset_response):
            self.faults_injected["reset_response"] += 1
            cut.limit = self.rng.randrange(1, 200)
        if (trap := self._trickled(request)) is not None:
            cut.trickle_s = trap.every_s
        strip = next((t for t in self._strips if t.hits < t.times and t.match(request.method, request.path)), None)
        if strip is not None:
            strip.hits += 1
            self.faults_injected["strip_etag"] += 1
            cut.strip_etag += 1
        self.requests[request.method] += 1
        dst.write(request.head)
        await dst.drain()
        await _copy_exact(src, dst, request.body_length)

    async def _answer_swallowed(self, request: _Request, src: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        """Read the PUT's body and answer 200 as the store would, storing nothing."""
        assert request.body_length is not None
        if request.expects_continue:
            client.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await client.drain()
        body = await src.readexactly(request.body_length)
        etag = hashlib.md5(body, usedforsecurity=False).hexdigest()
        client.write(f'HTTP/1.1 200 OK\r\nETag: "{etag}"\r\nContent-Length: 0\r\n\r\n'.encode())
        await client.drain()

    async def _answer_503(self, request: _Request, src: asyncio.StreamReader, client: asyncio.StreamWriter) -> None:
        assert request.body_length is not None
        if not request.expects_continue and request.body_length:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(src.readexactly(request.body_length), 5)
        body = b"" if request.method == "HEAD" else SLOW_DOWN
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        client.write(head + body)
        await client.drain()


async def _read_head(src: asyncio.StreamReader) -> _Request | None:
    """The next request's head; None at a clean end of the stream."""
    try:
        head = await src.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    if len(head) > MAX_HEAD_BYTES:
        raise _Cut
    lines = head.decode("latin-1").split("\r\n")
    method, _, rest = lines[0].partition(" ")
    path = rest.rpartition(" ")[0]
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    length: int | None = 0
    if "transfer-encoding" in headers:
        length = None
    elif "content-length" in headers:
        length = int(headers["content-length"])
    return _Request(
        method=method, path=path, head=head, body_length=length,
        expects_continue=headers.get("expect", "").lower() == "100-continue",
    )  # fmt: skip


async def _copy_exact(src: asyncio.StreamReader, dst: asyncio.StreamWriter, n: int) -> None:
    while n > 0:
        data = await src.read(min(n, 1 << 16))
        if not data:
            raise _Cut
        dst.write(data)
        await dst.drain()
        n -= len(data)


async def _copy_rest(src: asyncio.StreamReader, dst: asyncio.StreamWriter, stop: Callable[[], bool]) -> None:
    while (data := await src.read(1 << 16)) and not stop():
        dst.write(data)
        await dst.drain()
