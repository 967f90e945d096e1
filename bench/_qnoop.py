"""The raw django-q2 baseline's job: nothing at all, so its rate is the transport's."""


def noop(n: int) -> None:
    return None
