"""wrk driving many keep-alive clients at one URL, each answer counted by status, and every
refusal checked for what a client needs to retry: a JSON body and Retry-After. Standard library
only: benchmarks/overload.py drives the same.
"""

import re
import resource
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

WRK = shutil.which("wrk")

# Per thread: the answers by status, the refusals (3xx and up) without Retry-After or a JSON
# body, and the 2xx from WARMUP on over WINDOW whole seconds of the clock (os.time()'s
# resolution), which lie within the run when WINDOW is one short of its duration less WARMUP;
# summed over the threads when wrk is done.
COUNTING_SCRIPT = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) statuses = {} bare = 0 steady = 0 started = os.time() end
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
  local second = os.time() - started
  if status < 300 and second >= WARMUP and second < WARMUP + WINDOW then steady = steady + 1 end
  if status >= 300 and (headers["Retry-After"] == nil or body:sub(1, 1) ~= "{") then
    bare = bare + 1
  end
end
function done(summary, latency, requests)
  local total, without, counted = {}, 0, 0
  for _, thread in ipairs(threads) do
    for status, count in pairs(thread:get("statuses")) do
      total[status] = (total[status] or 0) + count
    end
    without = without + thread:get("bare")
    counted = counted + thread:get("steady")
  end
  for status, count in pairs(total) do io.write(string.format("status %d %d\\n", status, count)) end
  io.write(string.format("bare %d\\n", without))
  io.write(string.format("steady %d\\n", counted))
end
"""
SECONDS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


@dataclass
class WrkRun:
    statuses: dict[int, int]
    bare: int  # refusals without Retry-After or a JSON body
    steady: int  # 2xx within the window
    errors: dict[str, int]  # socket errors by kind: connect, read, write, timeout
    seconds: float
    percentiles: dict[int, float] = field(default_factory=dict)  # in seconds

    @property
    def ok(self) -> int:
        return sum(count for status, count in self.statuses.items() if 200 <= status < 300)


def lift_descriptor_limit() -> None:
    """wrk holds a descriptor per client: the soft limit raised to the hard one, in this process,
    which wrk inherits (a preexec_fn is unsafe beside threads)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start(url, key, clients, duration, directory: Path, warmup=0, timeout="30s", threads=2):
    """Start wrk on `url` with `clients` connections for `duration` seconds; finish() reads it.
    A client that waits `timeout` for an answer counts a timeout (wrk's own default is 2 s)."""
    lift_descriptor_limit()
    script = directory / "wrk-counts.lua"
    window = max(duration - warmup - 1, 0)
    script.write_text(f"WARMUP = {warmup}\nWINDOW = {window}\n{COUNTING_SCRIPT}")
    command = [
        WRK,
        f"--threads={min(threads, clients)}",
        f"--connections={clients}",
        f"--duration={duration}s",
        f"--timeout={timeout}",
        "--latency",
        "--script",
        str(script),
        "--header",
        f"Authorization: Bearer {key}",
        url,
    ]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen, timeout: float) -> WrkRun:
    output, errors_text = process.communicate(timeout=timeout)
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed ({process.returncode}): {errors_text}{output}")
    errors = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    took = re.search(r"requests in ([\d.]+)(us|ms|s|m)", output)
    return WrkRun(
        statuses={int(s): int(n) for s, n in re.findall(r"^status (\d+) (\d+)$", output, re.M)},
        bare=int(re.search(r"^bare (\d+)$", output, re.M)[1]),
        steady=int(re.search(r"^steady (\d+)$", output, re.M)[1]),
        errors=dict(
            zip(("connect", "read", "write", "timeout"), map(int, errors.groups()), strict=True)
        )
        if errors
        else {},
        seconds=float(took[1]) * SECONDS[took[2]],
        percentiles={
            int(percent): float(value) * SECONDS[unit]
            for percent, value, unit in re.findall(
                r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M
            )
        },
    )


def run(url, key, clients, duration, directory: Path, **options) -> WrkRun:
    return finish(start(url, key, clients, duration, directory, **options), duration + 60)
