"""manage.py replay_schedule: replay the recorded admissions of a window under another policy (tasks/replay.py)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from tasks import clock, replay
from tasks.models import Tenant


def parse_moment(text: str, option: str) -> datetime:
    """An ISO date or datetime; without a zone, in the project's time zone."""
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"{option} {text!r} is not an ISO date or datetime (e.g. 2026-03-01 or "
                           f"2026-03-01T12:00:00+00:00)") from None
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


def parse_weights(text: str) -> dict[str, int]:
    """slug=weight pairs separated by commas, each tenant once, each weight a whole number from 0."""
    weights: dict[str, int] = {}
    for pair in text.split(","):
        slug, sep, value = pair.strip().partition("=")
        slug = slug.strip()
        if not sep or not slug:
            raise CommandError(f"--weights {pair.strip()!r} is not slug=weight (e.g. acme=3,globex=1)")
        if not value.strip().isascii() or not value.strip().isdecimal():
            raise CommandError(f"--weights {slug}={value.strip()}: the weight must be a whole number from 0")
        if slug in weights:
            raise CommandError(f"--weights names {slug} twice")
        weights[slug] = int(value)
    unknown = sorted(set(weights) - set(Tenant.objects.filter(slug__in=list(weights)).values_list("slug", flat=True)))
    if unknown:
        raise CommandError(f"--weights names unknown tenants: {', '.join(unknown)}")
    return weights


class Command(BaseCommand):
    help = ("Replay the recorded admissions of [--from, --to) through the admission rules under another policy, "
            "in simulated time, and show per tenant the waits, slot share and refusals beside what happened.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--from", dest="start", required=True, help="ISO date or datetime, included.")
        parser.add_argument("--to", dest="end", help="ISO date or datetime, excluded (default: now).")
        parser.add_argument("--weights", help="Tenant weights to replay with, e.g. acme=3,globex=1.")
        parser.add_argument("--max-running", type=int, help="The system's running slots (LONGHAUL_MAX_RUNNING).")
        parser.add_argument("--aging-seconds", type=float, help="Seconds of waiting worth one priority point.")
        parser.add_argument("--json", dest="as_json", action="store_true", help="Print one JSON document.")

    def handle(self, *args: Any, start: str, end: str | None, weights: str | None, max_running: int | None,
               aging_seconds: float | None, as_json: bool, **options: Any) -> None:
        now = clock.now()
        window_start = parse_moment(start, "--from")
        window_end = parse_moment(end, "--to") if end else now
        if window_end <= window_start:
            raise CommandError(f"--to ({window_end.isoformat()}) must be after --from ({window_start.isoformat()})")
        if max_running is not None and max_running < 1:
            raise CommandError("--max-running must be at least 1")
        if aging_seconds is not None and not aging_seconds >= 1:  # also refuses nan
            raise CommandError("--aging-seconds must be at least 1 (as LONGHAUL_AGING_SECONDS)")
        overrides = replay.Overrides(weights=parse_weights(weights) if weights else {}, max_running=max_running,
                                     aging_seconds=aging_seconds)
        report = replay.replay(window_start, window_end, overrides, now=now)
        self.stdout.write(json.dumps(report.as_dict(), indent=2) if as_json else replay.render(report))

