"""`onepiece generate`: submit a video job to a proxy, show its progress, save the MP4.

    onepiece generate --model t2v --prompt "a cat surfing" --size 64x64 --seconds 1 -o cat.mp4
    onepiece generate --model i2v --prompt "it moves" --image cat.png --frames 9 -o cat.mp4
    onepiece generate --nm tcp://127.0.0.1:7700 --prompt "a cat surfing" -o cat.mp4   # any set

Imports stay light at module level: the CLI builds its parser from ``add_arguments`` on every
invocation, whatever the subcommand.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from onepiece.argtypes import SEED, count, non_negative, positive

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "ONEPIECE_URL"  # proxy URL(s), comma-separated, when --url is not given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of `onepiece generate` on ``parser``."""
    parser.add_argument("--model", help="application id: t2v, i2v, or any app of the workflow (default: i2v with "
                                        "--image, else t2v, as the API infers it)")
    parser.add_argument("--prompt", required=True, help="what the video shows")
    parser.add_argument("--negative-prompt", help="what it should not show")
    parser.add_argument("--image", help="input image (PNG/JPEG/...) for image-to-video")
    parser.add_argument("--size", default="64x64", help="WIDTHxHEIGHT, multiples of 16 (default 64x64)")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--seconds", type=positive(" seconds"), help="clip length; frames = 4*round(seconds*fps/4)+1")
    length.add_argument("--frames", type=count(), help="exact frame count, 4k+1 (e.g. 9, 17, 81)")
    parser.add_argument("--steps", type=count(), help="denoising steps")
    parser.add_argument("--guidance", type=non_negative(), help="classifier-free guidance scale")
    parser.add_argument("--seed", type=SEED, help="random seed (default: random)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", action="append",
                       help=f"proxy URL; repeat (or separate by commas) to fall back to other sets "
                            f"(default ${URL_ENV} or {DEFAULT_URL})")
    from onepiece.cli import _curve_flags, _nm_addresses, _refused

    where.add_argument("--nm", metavar="ADDR", type=_nm_addresses,
                       help="node manager address (e.g. tcp://127.0.0.1:7700): use every set's proxies, "
                            "going on to another set when one refuses")
    from onepiece.proxy.keys import CLIENT_ENV as KEY_ENV

    parser.add_argument("--api-key-file", metavar="PATH",
                        help=f"file of mode 0600 holding the API key for the proxies (default ${KEY_ENV})")
    parser.add_argument("--api-key", help=argparse.SUPPRESS, type=_refused(
        f"a key on a command line is readable by every user of the host (ps); put it in a file of mode 0600 named "
        f"by --api-key-file, or in the environment variable {KEY_ENV}"))
    _curve_flags(parser, auth=False)  # with --nm: the node manager of a deployment on CURVE
    parser.add_argument("--rounds", type=count(),
                        help="times to go round all proxies while they refuse or are unreachable, with backoff "
                             "(default: the Python client's, onepiece.client.ROUNDS)")
    parser.add_argument("--timeout", type=positive(" seconds"), default=600.0, help="seconds to wait for the video")
    parser.add_argument("--deadline", type=positive(" seconds"), metavar="SECONDS",
                        help="the request's own deadline (timeout_s): a set admits it only if it is predicted to "
                             "finish within it (default: twice its time through an idle set)")
    parser.add_argument("--slo", type=positive(" seconds"), metavar="SECONDS",
                        help="the latency the request aims for (slo_s, within --deadline): what the stages schedule "
                             "it for; missing it does not fail it")
    parser.add_argument("-o", "--output", required=True, help="where to save the MP4")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _urls(values: list[str] | None) -> list[str]:
    values = values or [os.environ.get(URL_ENV) or DEFAULT_URL]
    urls = [u.strip() for v in values for u in v.split(",") if u.strip()]
    return urls or [DEFAULT_URL]


def _check_output(path: str) -> None:
    """Raise OSError now if the MP4 cannot be written at ``path``, not after the video is made."""
    from onepiece.client import output_file

    try:
        target = output_file(path)
    except OSError as e:
        raise OSError(f"-o {e}") from e
    probe = target.with_name(f".{target.name}.part")  # the name the download writes before renaming
    try:
        with open(probe, "xb"):
            pass
    except FileExistsError:  # an earlier download's leftover; writable if it can be reopened
        open(probe, "ab").close()
    except OSError as e:
        raise OSError(f"-o {path}: cannot write there ({e.strerror})") from e
    probe.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    """Run `onepiece generate`; the process exit code (0 ok, 1 failed, 2 refused, 3 timeout)."""
    from tqdm import tqdm

    from onepiece.client import Client, RequestFailed, RequestRejected, Timeout
    from onepiece.proxy.keys import client_key
    from onepiece.secret_file import SecretFileError

    if args.nm:
        from onepiece.cli import _curve

        _curve(args, args.nm.split(","))
    extra = {"num_frames": args.frames, "steps": args.steps, "guidance": args.guidance, "seed": args.seed,
             "negative_prompt": args.negative_prompt, "timeout_s": args.deadline, "slo_s": args.slo}
    bar = tqdm(total=100, unit="%", desc="submitting", disable=args.quiet, file=sys.stderr,
               bar_format="{desc:>12} {percentage:3.0f}%|{bar}| {elapsed}")

    def on_progress(video: dict) -> None:
        target = 100 if video.get("status") == "completed" else int(video.get("progress") or 0)
        stage = video.get("stage") if video.get("status") == "in_progress" else None
        bar.set_description_str(stage or video.get("status", ""), refresh=False)
        if target > bar.n:
            bar.update(target - bar.n)
        else:
            bar.refresh()

    rounds = {} if args.rounds is None else {"rounds": max(1, args.rounds)}
    try:
        _check_output(args.output)
        key = client_key(args.api_key_file)
    except (OSError, SecretFileError) as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    video: dict | None = None
    try:
        client = (Client.from_nm(args.nm, api_key=key, **rounds) if args.nm
                  else Client(_urls(args.url), api_key=key, **rounds))
        with client:
            video = client.submit(args.prompt, model=args.model, image=args.image, size=args.size,
                                  seconds=args.seconds, **extra)
            if client.last_refusals and not args.quiet:
                bar.write(f"refused first by: {'; '.join(client.last_refusals)}", file=sys.stderr)
            on_progress(video)
            client.wait(video["id"], timeout=args.timeout, on_progress=on_progress)
            path = client.download(video["id"], args.output)
    except RequestRejected as e:
        bar.close()
        wait = f" (retry after {e.retry_after:g}s)" if e.retry_after is not None else ""
        print(f"refused: {e}{wait}", file=sys.stderr)
        return 2
    except Timeout as e:
        bar.close()
        print(f"timed out: {e}", file=sys.stderr)
        return 3
    except RequestFailed as e:
        bar.close()
        print(f"failed: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # unreadable --image, unwritable -o
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the video id is all that finds (or cancels) the video later
        bar.close()
        if video is None:
            print("interrupted before a proxy accepted the request (it may still have been created)", file=sys.stderr)
        else:
            served = f" on set {video['set']}" if video.get("set") else ""
            print(f"interrupted: video {video['id']}{served} is left as it is: one not finished goes on "
                  f"unless cancelled (DELETE /v1/videos/{video['id']})", file=sys.stderr)
        return 130
    bar.close()
    served = f" (set {video['set']})" if video.get("set") else ""
    print(f"{video['id']} -> {path}{served}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onepiece generate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
