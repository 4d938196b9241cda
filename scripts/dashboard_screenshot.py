"""Save a screenshot of `asyncengine monitor` as SVG (and PNG when a converter exists).

Against a live server, it runs the dashboard headless until it has received enough
snapshots to draw some history, then saves the screen:

    python scripts/dashboard_screenshot.py --url ws://127.0.0.1:8765 --png docs/dashboard.png

Without --url it plays the seeded demo engine of `frontends.dashboard.demo` (a busy GPU
server), which needs nothing but this repository. The SVG goes next to the PNG unless
--svg says otherwise; the PNG is made with cairosvg when it is installed, else with
`rsvg-convert` when it is on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a plain script from a checkout
    sys.path.insert(0, str(ROOT))

from frontends.dashboard import (  # noqa: E402
    Connected,
    MonitorApp,
    ScriptedStatsSource,
    WebSocketStatsSource,
)
from frontends.dashboard.demo import demo_frames  # noqa: E402


def parse_size(text: str) -> tuple[int, int]:
    """'120x40' -> (120, 40)."""
    width, _, height = text.lower().partition("x")
    return int(width), int(height)


async def screenshot(args: argparse.Namespace) -> str:
    """Run the app headless and return its screen as SVG."""
    if args.url:
        source = WebSocketStatsSource(args.url, api_key=args.api_key, interval=args.interval)
    else:
        demo_url = "ws://127.0.0.1:8765"
        source = ScriptedStatsSource(
            [Connected(url=demo_url), *demo_frames(args.frames, seed=args.seed)], url=demo_url
        )
    app = MonitorApp(source, title=args.title)
    async with app.run_test(size=parse_size(args.size)) as pilot:
        if isinstance(source, ScriptedStatsSource):
            await source.wait_consumed()
        else:
            async with asyncio.timeout(args.timeout):
                while app.snapshots_received < args.snapshots:
                    await asyncio.sleep(0.1)
        await pilot.pause()
        await pilot.wait_for_scheduled_animations()
        return app.export_screenshot(title=args.title or app.title)


def local_fonts(svg: str, font: str) -> str:
    """Point the SVG at a monospace font installed here.

    The SVG names Fira Code and fetches it from a CDN, which a browser does but offline
    converters can't; their fallback font may not be monospace, and the box-drawing
    characters then drift out of their cells. The font is also scaled a little so that its
    advance (0.602 em in the DejaVu/Menlo family) fills the 0.61 em cell the SVG assumes;
    otherwise long runs of block characters fall short and leave gaps.
    """
    svg = svg.replace("font-family: Fira Code, monospace;", f'font-family: "{font}", monospace;')
    return svg.replace("font-size: 20px;", "font-size: 20.27px;", 1)


def to_png(svg_path: Path, png_path: Path, scale: float, font: str) -> str | None:
    """Convert with whatever is available; returns the tool used, or None."""
    svg = local_fonts(svg_path.read_text(encoding="utf-8"), font)
    try:
        import cairosvg
    except ImportError:
        cairosvg = None
    if cairosvg is not None:
        cairosvg.svg2png(bytestring=svg.encode(), write_to=str(png_path), scale=scale)
        return "cairosvg"
    rsvg = shutil.which("rsvg-convert")
    if rsvg:
        subprocess.run(
            [rsvg, "--zoom", str(scale), "-o", str(png_path)], input=svg.encode(), check=True
        )
        return "rsvg-convert"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="server WebSocket URL; omit to use the demo engine")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds per snapshot")
    parser.add_argument(
        "--snapshots", type=int, default=30, help="live: snapshots to collect before the screenshot"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="live: give up after this many seconds"
    )
    parser.add_argument("--frames", type=int, default=96, help="demo: snapshots to play")
    parser.add_argument("--seed", type=int, default=0, help="demo: random seed")
    parser.add_argument("--size", default="120x40", help="terminal size, WIDTHxHEIGHT")
    parser.add_argument("--title", default=None)
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument(
        "--svg", type=Path, default=None, help="SVG path (default: the PNG's, as .svg)"
    )
    parser.add_argument("--scale", type=float, default=1.5, help="PNG scale factor")
    parser.add_argument(
        "--font", default="DejaVu Sans Mono", help="installed monospace font for the PNG"
    )
    args = parser.parse_args(argv)

    svg = asyncio.run(screenshot(args))
    svg_path = args.svg or args.png.with_suffix(".svg")
    svg_path.parent.mkdir(parents=True, exist_ok=True)
    svg_path.write_text(svg, encoding="utf-8")
    print(f"wrote {svg_path}")
    args.png.parent.mkdir(parents=True, exist_ok=True)
    tool = to_png(svg_path, args.png, args.scale, args.font)
    if tool:
        print(f"wrote {args.png} ({tool})")
    else:
        print("no SVG converter found (pip install cairosvg); PNG not written")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
