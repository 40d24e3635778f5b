"""Retrieval for search environments: the retriever interface, BM25 in process, and Search-R1's retrieval server.

A retriever is any callable `(queries: list[str], k: int) -> list[list[Passage]]`: the top `k` passages of each query,
best first. Three ship:

- `BM25Retriever`: BM25 (`bm25s`: lower case, English stopwords, no stemming) in this process. Ties are broken by the
  corpus order (the earlier passage first), so identical queries of a task group return identical results; passages
  that share no token with the query are not returned. `BM25Retriever.from_corpus_file` indexes a corpus file once per
  machine: the index is saved in the cache folder (`gigpo_trl.paths.cache_root()/bm25/<sha256 of the file>`) and
  loaded memory-mapped, so the environment workers of a machine share its pages instead of each holding a copy.
- `HTTPRetriever`: a client of Search-R1's retrieval-server protocol, which Search-R1 and verl-agent users run:
  `POST /retrieve` with `{"queries": [...], "topk": k, "return_scores": true}`, answered by `{"result": [[{"document":
  {"id": ..., "contents": ...}, "score": ...}, ...], ...]}`, one list per query (without `return_scores` each item is
  the document itself). An outage is waited out: a refused connection or a 5xx answer is tried again with a pause
  that doubles, for `wait` seconds in all (`gigpo_trl.services.wait_out`, which says while it waits what it waits
  for); a server that stays down longer, times out (not tried again) or answers something else raises a
  `RetrieverError` naming the URL and what came back (in an environment pool, that fails the trajectory and the run
  goes on).
- `serve`: a small server of that protocol (stdlib `ThreadingHTTPServer`) over a `BM25Retriever`:
  `python -m gigpo_trl.environments.retrieval --corpus corpus.jsonl --port 8000` (host 127.0.0.1 by default).

Data, as Search-R1's: a corpus is a jsonl file of `{"id", "contents"}` lines (`contents` starts with the title in
quotes on its first line; `id` defaults to the line's index); QA rows are jsonl lines with a `question` and
`golden_answers` (a list), and optionally `data_source`. A line that does not fit is refused at load, naming its file
and line number.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from gigpo_trl.paths import cache_root
from gigpo_trl.services import DEFAULT_SERVICE_WAIT, ServiceUnavailable, wait_out

STOPWORDS = "en"  # bm25s's English list (search QA's generated names keep every token: tests/test_search_qa.py)
DEFAULT_TOPK = 3


@dataclass(frozen=True)
class Passage:
    """A passage of a corpus: its `id`, its `contents` (title in quotes on the first line), and the `score` a search
    gave it."""

    id: str
    contents: str
    score: float = 0.0


Retriever = Callable[[list[str], int], list[list[Passage]]]


class RetrieverError(RuntimeError):
    """A retriever could not answer: says which one and why."""


@dataclass(frozen=True)
class QARow:
    """A question and its golden answers (any of them is right); `data_source` names its kind (the task type)."""

    question: str
    golden_answers: tuple[str, ...]
    data_source: str = "qa"

    @classmethod
    def of(cls, row: Mapping[str, Any], where: str) -> QARow:
        """A row's `question`, `golden_answers` (a non-empty list of strings, or one string) and `data_source`.

        Raises:
            ValueError: naming `where` and what is missing.
        """
        question, answers = row.get("question"), row.get("golden_answers")
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: a QA row needs a non-empty `question`")
        if not isinstance(answers, list | tuple) or not answers or not all(isinstance(a, str) and a.strip()
                                                                          for a in answers):
            raise ValueError(f"{where}: a QA row needs `golden_answers`, a non-empty list of answers, got {answers!r}")
        return cls(question.strip(), tuple(answers), str(row.get("data_source") or "qa"))


def read_corpus(path: str | Path) -> list[Passage]:
    """The passages of a corpus file (see the module docstring).

    Raises:
        ValueError: a line is not a JSON object or has no string `contents`, naming the file and the line.
    """
    passages = []
    for number, row in _jsonl(path):
        if not isinstance(row.get("contents"), str):
            raise ValueError(f"{path}, line {number}: a corpus line needs `contents`, a string, got {sorted(row)}")
        passages.append(Passage(str(row.get("id", len(passages))), row["contents"]))
    return passages


def read_qa(path: str | Path) -> list[QARow]:
    """The QA rows of a jsonl file (see the module docstring).

    Raises:
        ValueError: a line is not a JSON object or not a QA row, naming the file and the line; an empty file.
    """
    rows = [QARow.of(row, f"{path}, line {number}") for number, row in _jsonl(path)]
    if not rows:
        raise ValueError(f"{path}: no QA rows")
    return rows


def _jsonl(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a jsonl file."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}, line {number}: a line must be a JSON object, got {type(row).__name__}")
            yield number, row


@dataclass(frozen=True)
class Analyzer:
    """How BM25 reads text: `stopwords` (bm25s's list by name, e.g. "en", or the words), `stemmer` (a PyStemmer
    algorithm, e.g. "porter"; None: no stemming), and BM25's `k1` and `b` (bm25s's "lucene" scoring). The default is
    search QA's: bm25s's English stopwords, no stemming, k1 1.5 and b 0.75."""

    stopwords: str | tuple[str, ...] = STOPWORDS
    stemmer: str | None = None
    k1: float = 1.5
    b: float = 0.75

    def tokens(self, texts: Sequence[str]) -> list[list[str]]:
        """The BM25 tokens of each text: lower-case words of two characters or more, less the stopwords, stemmed."""
        import bm25s  # noqa: PLC0415 (imported where retrieval runs)

        return bm25s.tokenize(list(texts), stopwords=self._stopwords, stemmer=self._stem, return_ids=False,
                              show_progress=False)

    def index(self, texts: Sequence[str]) -> Any:
        """A `bm25s.BM25` index of the texts."""
        import bm25s  # noqa: PLC0415

        index = bm25s.BM25(k1=self.k1, b=self.b)
        index.index(bm25s.tokenize(list(texts), stopwords=self._stopwords, stemmer=self._stem, show_progress=False),
                    show_progress=False)
        return index

    @property
    def _stopwords(self) -> str | list[str]:
        return self.stopwords if isinstance(self.stopwords, str) else list(self.stopwords)

    @property
    def _stem(self) -> Callable[[list[str]], list[str]] | None:
        if self.stemmer is None:
            return None
        import Stemmer  # noqa: PLC0415 (PyStemmer)

        return Stemmer.Stemmer(self.stemmer).stemWords


def tokenize(texts: Sequence[str]) -> list[list[str]]:
    """The BM25 tokens of each text under the default analyzer: lower case words of two characters or more, less
    English stopwords."""
    return Analyzer().tokens(texts)


class BM25Retriever:
    """BM25 over passages, in this process (see the module docstring).

    Args:
        passages: the corpus, indexed now and kept in memory.
        analyzer: how the passages and the queries are read (default: search QA's, `Analyzer()`).
    """

    def __init__(self, passages: Sequence[Passage], analyzer: Analyzer = Analyzer()) -> None:
        self.analyzer = analyzer
        self._bm25 = analyzer.index([passage.contents for passage in passages])
        self._ids = [passage.id for passage in passages]
        self._contents: Sequence[str] = [passage.contents for passage in passages]

    @classmethod
    def from_corpus_file(cls, path: str | Path, cache: str | Path | None = None,
                         analyzer: Analyzer = Analyzer()) -> BM25Retriever:
        """BM25 over a corpus file, indexed once per machine (per analyzer) and loaded memory-mapped (see the module
        docstring).

        Args:
            path: the corpus (jsonl).
            cache: the folder of saved indexes; default `cache_root() / "bm25"`.
            analyzer: how the passages and the queries are read.
        """
        import bm25s  # noqa: PLC0415

        folder = _saved_index(Path(path), Path(cache) if cache is not None else cache_root() / "bm25", analyzer)
        retriever = cls.__new__(cls)
        retriever.analyzer = analyzer
        retriever._bm25 = bm25s.BM25.load(folder, mmap=True, show_progress=False)
        retriever._ids = json.loads((folder / "ids.json").read_text())
        retriever._contents = _Lines(folder / "contents.jsonl", np.load(folder / "offsets.npy", mmap_mode="r"))
        return retriever

    def __len__(self) -> int:
        return len(self._ids)

    def __call__(self, queries: list[str], k: int) -> list[list[Passage]]:
        return [self._top(tokens, k) for tokens in self.analyzer.tokens(queries)]

    def _top(self, tokens: list[str], k: int) -> list[Passage]:
        known = [token for token in tokens if token in self._bm25.vocab_dict]
        if not known:
            return []
        scores = self._bm25.get_scores(known)  # float [num passages]
        # the passages that share a token with the query (selecting among all of them, mostly equal zeros, is slow)
        matched = np.flatnonzero(scores)
        values = scores[matched]
        if len(values) > k:  # those at least as good as the k-th best, ties at the edge included
            keep = values >= np.partition(values, len(values) - k)[len(values) - k]
            matched, values = matched[keep], values[keep]
        best = matched[np.lexsort((matched, -values))][:k]  # by score, then corpus order
        return [Passage(self._ids[i], self._contents[i], float(scores[i])) for i in best]


class _Lines:
    """The passages' contents in a saved index's jsonl file, memory-mapped and read by offset (list-like)."""

    def __init__(self, path: Path, offsets: np.ndarray) -> None:
        self._data = np.memmap(path, dtype=np.uint8, mode="r")
        self._offsets = offsets

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> str:
        return json.loads(self._data[self._offsets[index]:self._offsets[index + 1]].tobytes())


def _saved_index(corpus: Path, cache: Path, analyzer: Analyzer) -> Path:
    """The folder of the corpus's saved index in `cache`, built now if no process of this machine built it before
    (one process builds it, under a file lock; the others wait and load it). The default analyzer's folder is named by
    the corpus's digest alone, another's by the digest of the corpus and the analyzer."""
    digest = hashlib.sha256()
    with open(corpus, "rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    if analyzer != Analyzer():
        digest.update(repr(analyzer).encode())
    folder = cache / digest.hexdigest()
    if folder.is_dir():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():
            _build_index(read_corpus(corpus), folder, analyzer)
    return folder


def _build_index(passages: Sequence[Passage], folder: Path, analyzer: Analyzer) -> None:
    """Save the index, the ids and the contents of `passages` into `folder` (written beside it, then renamed)."""
    building = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{folder.name}.building-"))
    try:
        analyzer.index([passage.contents for passage in passages]).save(building, show_progress=False)
        (building / "ids.json").write_text(json.dumps([passage.id for passage in passages]))
        offsets = [0]
        with open(building / "contents.jsonl", "wb") as contents:
            for passage in passages:
                offsets.append(offsets[-1] + contents.write(json.dumps(passage.contents).encode() + b"\n"))
        np.save(building / "offsets.npy", np.array(offsets, dtype=np.int64))
        building.rename(folder)
    finally:
        shutil.rmtree(building, ignore_errors=True)


class HTTPRetriever:
    """A client of Search-R1's retrieval server (see the module docstring).

    Args:
        url: the server's endpoint, e.g. "http://127.0.0.1:8000/retrieve".
        timeout: seconds to wait for an answer (not retried: a server that hangs would hang again).
        wait: seconds an outage is waited out (a refused connection, a 5xx answer), tried again with a pause that
            doubles, before the request fails (`gigpo_trl.services.wait_out`); 0: no second try. The default is
            long enough for a retrieval server to restart (loading an E5 index takes a minute or more).
    """

    def __init__(self, url: str, *, timeout: float = 30.0, wait: float = DEFAULT_SERVICE_WAIT) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever_url must be an http(s) URL (e.g. http://127.0.0.1:8000/retrieve), got {url!r}")
        if timeout <= 0 or wait < 0:
            raise ValueError(f"timeout must be > 0 and wait >= 0, got {timeout} and {wait}")
        self.url, self.timeout, self.wait = url, timeout, wait

    def __call__(self, queries: list[str], k: int) -> list[list[Passage]]:
        body = json.dumps({"queries": list(queries), "topk": k, "return_scores": True}).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})

        def ask() -> bytes:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read()

        try:
            raw = wait_out(ask, service=f"the retrieval server {self.url}", retry_reason=_outage, wait=self.wait,
                           call_timeout=self.timeout)
        except ServiceUnavailable as exc:
            raise RetrieverError(str(exc)) from None
        except urllib.error.HTTPError as exc:
            raise RetrieverError(f"the retrieval server {self.url} answered HTTP {exc.code}: {_excerpt(exc.read())}") from None
        except OSError as exc:  # urllib's URLError and timeouts, which are not retried
            raise RetrieverError(f"the retrieval server {self.url} did not answer within {self.timeout:g} s"
                                 if _timed_out(exc) else f"the retrieval server {self.url} failed: {exc}") from None
        return _results(raw, len(queries), self.url)


def _outage(exc: Exception) -> str | None:
    """Why a request failed, where trying again may help: a server that refuses connections or answers 5xx (it is
    restarting, or overloaded); None for a 4xx answer or a timeout (the same again, or another hang)."""
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}" if exc.code >= 500 else None
    if isinstance(exc, OSError) and not _timed_out(exc):
        return str(getattr(exc, "reason", exc))
    return None


def _timed_out(exc: OSError) -> bool:
    return isinstance(getattr(exc, "reason", exc), TimeoutError)


def _results(raw: bytes, count: int, url: str) -> list[list[Passage]]:
    """The passages of a server's answer to `count` queries.

    Raises:
        RetrieverError: the answer is not one list of documents per query, naming the URL and what came back.
    """
    def garbage(what: str) -> RetrieverError:
        return RetrieverError(f"the retrieval server {url} answered {what}, not Search-R1's {{\"result\": [[...], ...]}} "
                              f"with one list per query: {_excerpt(raw)}")

    try:
        answer = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise garbage("something that is not JSON") from None
    result = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(result, list) or len(result) != count or not all(isinstance(items, list) for items in result):
        raise garbage(f"no list of {count} result lists")
    passages = []
    for items in result:
        found = []
        for item in items:
            document = item.get("document", item) if isinstance(item, dict) else None
            if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
                raise garbage("a document without `contents`")
            contents = document["contents"]
            passage_id = str(document["id"]) if "id" in document else hashlib.sha1(contents.encode()).hexdigest()[:16]
            found.append(Passage(passage_id, contents, float(item.get("score", 0.0))))
        passages.append(found)
    return passages


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= 200 else text[:200] + "...")


def serve(retriever: Retriever, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A server of Search-R1's protocol (`POST /retrieve`) over `retriever`, bound and not yet serving: call its
    `serve_forever()` (port 0: a free port, `server.server_address[1]`). A request that does not fit the protocol
    gets HTTP 400 with `{"error": why}`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.rstrip("/") != "/retrieve":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no {self.path}: the endpoint is POST /retrieve"})
                return
            try:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                queries, k, scores = _request(request)
            except ValueError as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                return
            found = retriever(queries, k)
            self._send(HTTPStatus.OK, {"result": [
                [{"document": {"id": p.id, "contents": p.contents}, "score": p.score} if scores else
                 {"id": p.id, "contents": p.contents} for p in passages] for passages in found]})

        def _send(self, status: HTTPStatus, answer: dict[str, Any]) -> None:
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass  # a line per request would flood a training run's output

    return _Server((host, port), Handler)


class _Server(ThreadingHTTPServer):
    # The workers of a pool connect at once: with socketserver's backlog of 5 the kernel drops the connections beyond
    # it, and each dropped client waits a second or more before its TCP tries again (64 environments: 2.8 s a turn).
    request_queue_size = 1024


def _request(request: Any) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a request body; ValueError saying what does not fit."""
    if not isinstance(request, dict):
        raise ValueError("the body must be a JSON object with `queries` (a list of strings), `topk` and `return_scores`")
    queries, k, scores = request.get("queries"), request.get("topk", DEFAULT_TOPK), request.get("return_scores", False)
    if not isinstance(queries, list) or not all(isinstance(query, str) for query in queries):
        raise ValueError("`queries` must be a list of strings")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"`topk` must be an int >= 1, got {k!r}")
    if not isinstance(scores, bool):
        raise ValueError(f"`return_scores` must be true or false, got {scores!r}")
    return queries, k, scores


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve BM25 over a corpus with Search-R1's retrieval protocol.")
    parser.add_argument("--corpus", required=True, help="the corpus: a jsonl file of {\"id\", \"contents\"} lines")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="the port (0: a free one)")
    args = parser.parse_args(argv)
    retriever = BM25Retriever.from_corpus_file(args.corpus)
    server = serve(retriever, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"BM25 over {len(retriever)} passages of {args.corpus} at http://{host}:{port}/retrieve", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    server.server_close()


if __name__ == "__main__":
    sys.exit(main())
