"""The operator's API client is rate-limited (a token bucket, as client-go's): a burst passes at once, then
requests are spaced at the rate."""

from __future__ import annotations

from grpolora.operator.kube import RateLimiter


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


async def test_a_burst_passes_then_requests_are_spaced_at_the_rate():
    time = FakeTime()
    limiter = RateLimiter(qps=10, burst=3, clock=time.clock, sleep=time.sleep)
    for _ in range(5):
        await limiter.acquire()
    assert time.slept == [0.1, 0.1]


async def test_idle_time_refills_the_bucket_up_to_the_burst():
    time = FakeTime()
    limiter = RateLimiter(qps=10, burst=2, clock=time.clock, sleep=time.sleep)
    for _ in range(2):
        await limiter.acquire()
    time.now += 60  # a quiet minute refills only up to the burst
    for _ in range(3):
        await limiter.acquire()
    assert time.slept == [0.1]
