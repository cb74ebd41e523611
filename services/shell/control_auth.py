"""Who may say what on ``baton.control``: the one rule, checked by the broker-vouched user_id.

Any party that may publish to the fanout exchange ``baton.control`` reaches every service (the
client role must, to cancel). So a message's kind alone proves nothing; its AMQP ``user_id``
does — RabbitMQ refuses a ``user_id`` that is not the publishing connection's own:

- ``drain`` stops intake of every drainable worker: only from an operator
  (``BATON_OPERATORS``, the broker users of ``python -m deploy.permissions``' operator
  role);
- ``abort`` drops a request silently in the workers: only from a trusted publisher (the
  detokenizer sends them, ``BATON_TRUSTED_PUBLISHERS``);
- ``cancel`` ends one request: only from the user that published that request (its start
  carries the request's ``user_id``, ``StartInfo.owner``). The detokenizer checks it, answers
  ``cancelled`` and sends the workers an ``abort``; the workers themselves act on aborts only.

Anything else is logged and ignored. With neither setting (one shared broker user, development)
every control message is honoured, as there is nobody to tell apart.
"""

from __future__ import annotations

from shared.config import BatonConfig


def user_set(csv: str) -> frozenset[str]:
    return frozenset(u.strip() for u in csv.split(",") if u.strip())


class ControlAuth:
    def __init__(self, config: BatonConfig) -> None:
        self.trusted = user_set(config.trusted_publishers)
        self.operators = user_set(config.operators)
        self.checking = bool(self.trusted or self.operators)

    def may_drain(self, user_id: str | None) -> bool:
        return not self.checking or user_id in self.operators

    def may_abort(self, user_id: str | None) -> bool:
        return not self.trusted or user_id in self.trusted

    def may_cancel(self, owner: str | None, user_id: str | None) -> bool:
        """``owner``: who published the request. A request or cancel that names no user is
        nobody's to cancel while users are told apart (anyone could send such a cancel)."""
        return not self.checking or (owner is not None and owner == user_id)
