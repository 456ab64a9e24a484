"""``kvstream query``: ask a running worker's HTTP views, or a ``kvstream index`` replica's router APIs, and
print the JSON answer; ``--wait-caught-up`` first waits until the workers have consumed their input.

:func:`add_query` adds the subparser (flags, help texts) for :func:`kvstream.cli.build_parser`; ``_cmd_query``
runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from kvstream.options import add_settings_arguments, positive_int


def _error(message: str) -> None:
    """Print ``message`` as this command's error line, named as :func:`kvstream.options.run_command` names the
    other commands'."""
    print(f"kvstream query: error: {message}", file=sys.stderr)


def _urlopen(settings, request, timeout: float):
    """``urllib.request.urlopen`` with the settings' token (``Authorization: Bearer``) and, for an https:// URL,
    their TLS context (``--web-ca``, ``--web-client-cert``)."""
    from stream_apps.web_access import client_ssl_context

    if isinstance(request, str):
        request = urllib.request.Request(request)
    options = settings.client_options()
    if options["token"]:
        request.add_header("Authorization", f"Bearer {options['token']}")
    context = None
    if request.full_url.startswith("https://"):
        context = client_ssl_context(options["ca_file"], options["cert_file"], options["key_file"],
                                     options["key_password"])
    return urllib.request.urlopen(request, timeout=timeout, context=context)


def add_query(sub: argparse._SubParsersAction) -> None:
    """``kvstream query``: which view, its block hashes or token ids, and the tokens' options."""
    from kvstream.settings import QuerySettings

    p = sub.add_parser("query", help="ask a running worker or index: residency of a block, prefix match, a "
                                     "prompt's tokens, occupancy, sources, workers, stats",
                       description="Query a stream-app worker's HTTP views (or a 'kvstream index' replica's: "
                                   "prefix-match, tokens, workers) and print the JSON answer. Any worker answers "
                                   "for the whole fleet.",
                       epilog="examples:\n"
                              "  kvstream query occupancy --wait-caught-up    # once the workers have consumed "
                              "everything\n"
                              "  kvstream query residency e220a8397b1dcdaf\n"
                              "  kvstream query prefix-match e220a8397b1dcdaf 5c1a5e1f3a0b7c44\n"
                              "  kvstream query tokens --token-file prompt.json --block-size 16 --model llama\n"
                              "  kvstream query workers --worker-url http://127.0.0.1:6080",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["residency", "prefix-match", "tokens", "occupancy", "sources", "workers",
                                    "stats"], help="which view")
    p.add_argument("block_hash", nargs="*", help="block hash: 16 or 64 hex digits, or a decimal integer as vLLM or "
                                                 "SGLang logs it (residency: one; prefix-match: the "
                                                 "request's blocks in prefix order); for tokens: token ids")
    p.add_argument("--token-file", default=None, help="tokens: a JSON list of token ids (added after any given "
                                                      "as arguments)")
    p.add_argument("--model", default=None, help="tokens: only instances serving this model (default: any)")
    p.add_argument("--lora-name", default=None, help="tokens: the request's LoRA adapter")
    p.add_argument("--cache-salt", default=None, help="tokens: the request's cache salt")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens: tokens per block (default: each instance's registered block size)")
    add_settings_arguments(p, QuerySettings)
    p.set_defaults(func=_cmd_query)


def _query_tokens(args: argparse.Namespace, settings) -> int:
    """``kvstream query tokens``: ``POST /query`` with the token ids given, printed as JSON."""
    from kvstream.client import IndexClient, IndexQueryError

    try:
        tokens = [int(t) for t in args.block_hash]
    except ValueError:
        _error("query tokens takes token ids (integers), e.g. 'kvstream query tokens 1 2 3'")
        return 2
    if args.token_file is not None:
        try:
            tokens += [int(t) for t in json.loads(Path(args.token_file).read_text())]
        except (OSError, ValueError, TypeError) as exc:
            _error(f"--token-file {args.token_file}: expected a JSON list of token ids ({exc})")
            return 2
    if not tokens:
        _error("query tokens needs token ids, as arguments or with --token-file")
        return 2
    options = {"model_name": args.model, "lora_name": args.lora_name, "cache_salt": args.cache_salt,
               "block_size": args.block_size}
    try:
        with IndexClient(settings.worker_url, timeout_s=settings.request_timeout_s,
                         **settings.client_options()) as client:
            answer = client.query(tokens, **options)
    except IndexQueryError as exc:
        _error(str(exc))
        return 1
    except OSError as exc:
        _error(f"no index or worker answered at {settings.worker_url}: {exc}")
        return 1
    print(json.dumps(answer, indent=2))
    if warning := _empty_because_down(settings, answer):
        print(warning, file=sys.stderr)
    return 0


def _empty_because_down(settings, answer: dict) -> str | None:
    """The warning for an empty lookup (no ``rows``, ``matches`` or ``instances``) while sources are down, else
    None. A source not heard of for ``--source-lease-s`` (30 s) is left out of every lookup: 30 s after
    ``kvstream simulate`` ends, every lookup of the README's by-hand steps answered empty without a word (issue
    28). One ``GET /workers`` (a worker's or an index's), only when the answer is empty; no warning when it fails."""
    if any(answer.get(field) for field in ("rows", "matches", "instances")):
        return None
    try:
        with _urlopen(settings, settings.worker_url + "/workers", settings.request_timeout_s) as response:
            sources = json.loads(response.read())["workers"]
        down = sum(1 for source in sources if source.get("live") is False)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not down:
        return None
    return (f"warning: the answer is empty, and {down:,} of {len(sources):,} sources are down (no event or heartbeat "
            "within the workers' --source-lease-s): their blocks are left out of every lookup until they are heard "
            "from again (kvstream query workers lists them; docs/residency.md#liveness)")


def _lag_text(answer: dict) -> str:
    """How far the workers are behind, from a fleet view's answer (``lag``, ``lag_by_topic``, ``lag_error``)."""
    if answer.get("lag") is None:
        return f"their lag is unknown ({answer.get('lag_error') or 'no reading'})"
    topics = ", ".join(f"{topic} {lag:,}" for topic, lag in sorted(answer.get("lag_by_topic", {}).items()) if lag)
    return f"{answer['lag']:,} messages of their input to go" + (f" ({topics})" if topics else "")


def _wait_caught_up(settings, poll_s: float = 1.0) -> int:
    """Poll ``GET /occupancy/`` until the workers report ``caught_up`` and two answers ``poll_s`` apart agree;
    progress on standard error. Returns 0 once they have, else the exit code (1: the wait timed out, or the URL
    is no worker's).

    Why the second answer: ``caught_up`` says the workers have consumed and committed their input, so every
    table change is in the changelogs; the global tables (occupancy, sources) reach the other workers' copies
    through those changelogs a little later (the commits produced them; then each worker reads them).
    Once the input is consumed nothing else changes them, so an answer equal to the one before is the whole one.
    """
    import time

    url = settings.worker_url + "/occupancy/"
    started = time.monotonic()
    said = None
    settled = None  # the occupancy of the last caught-up answer
    while True:
        try:
            with _urlopen(settings, url, settings.request_timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            _error(f"--wait-caught-up: {url} answered HTTP {exc.code}: it needs a stream-app worker's URL "
                   "(a 'kvstream index' replica has no /occupancy/)")
            return 1
        except (OSError, ValueError) as exc:  # not up yet (a worker starting), or a broken answer
            answer = {"lag": None, "lag_error": f"no worker answered at {settings.worker_url}: {exc}"}
        if "caught_up" not in answer and "lag_error" not in answer:
            _error(f"--wait-caught-up: {url} does not say whether it has caught up (a worker older than this "
                   "command?)")
            return 1
        if answer.get("caught_up"):
            if settled is not None and answer.get("occupancy") == settled:
                if said is not None:
                    print(f"the workers have caught up ({time.monotonic() - started:.0f} s)", file=sys.stderr)
                return 0
            settled = answer.get("occupancy")
        else:
            settled = None
        waited = time.monotonic() - started
        if waited >= settings.wait_timeout_s:
            _error(f"the workers have not caught up after {settings.wait_timeout_s:g} s: {_lag_text(answer)}")
            return 1
        text = "the global tables' copies are settling" if settled is not None else _lag_text(answer)
        if text != said and (settled is None or said is not None):  # the settling of an idle fleet goes unsaid
            print(f"waiting for the workers to catch up: {text}", file=sys.stderr)
            said = text
        time.sleep(min(poll_s, max(settings.wait_timeout_s - waited, 0.0)))


def _cmd_query(args: argparse.Namespace) -> int:
    from kvstream.options import settings_from_args
    from kvstream.settings import QuerySettings
    from schemas import InvalidBlockHash, parse_block_hash

    settings = settings_from_args(QuerySettings, args)
    if settings.wait_caught_up and (code := _wait_caught_up(settings)):
        return code
    if args.what == "tokens":
        return _query_tokens(args, settings)
    data = None
    try:  # refused here, with the accepted forms, rather than by the worker
        hashes = [parse_block_hash(text).hex() for text in args.block_hash]
    except InvalidBlockHash as exc:
        _error(str(exc))
        return 2
    if args.what == "residency":
        if len(hashes) != 1:
            _error("query residency needs one block hash")
            return 2
        path = f"/residency/{urllib.parse.quote(hashes[0])}/"
    elif args.what == "prefix-match":
        if not hashes:
            _error("query prefix-match needs the request's block hashes, in prefix order")
            return 2
        path, data = "/prefix-match/", json.dumps({"block_hashes": hashes}).encode()
    elif hashes:
        _error(f"query {args.what} takes no block hash")
        return 2
    else:
        path = "/workers" if args.what == "workers" else f"/{args.what}/"
    request = urllib.request.Request(settings.worker_url + path, data=data,
                                     headers={"Content-Type": "application/json"} if data else {})
    try:
        with _urlopen(settings, request, settings.request_timeout_s) as response:
            answer = json.loads(response.read())
        print(json.dumps(answer, indent=2))
        if args.what in ("residency", "prefix-match") and (warning := _empty_because_down(settings, answer)):
            print(warning, file=sys.stderr)
        if isinstance(answer, dict) and answer.get("caught_up") is False:
            print(f"warning: the workers have not caught up with their input, {_lag_text(answer)}: these figures "
                  "are partial (--wait-caught-up waits for them)", file=sys.stderr)
        return 0
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            body = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            pass
        _error(f"HTTP {exc.code}: {body}")
    except OSError as exc:
        _error(f"no stream-app worker answered at {settings.worker_url}: {exc}")
    return 1
