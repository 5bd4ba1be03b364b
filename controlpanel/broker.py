"""kombu's filesystem transport, with messages that appear whole.

kombu's own writer creates a message file and fills it afterwards; a Celery worker that
lists the folder in between moves the empty file away, fails to decode it and its consumer
dies (seen under load: the beat schedule stopped being served). Here a message is written
under a name the reader skips and renamed into place, which is atomic on one filesystem.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

ALIAS = "cpfs"  # CELERY_BROKER_URL = "cpfs://"


class AtomicChannel(filesystem.Channel):
    # The stubs of kombu disagree between its base and filesystem channels; this follows
    # the filesystem one, which is what kombu calls.
    def _put(self, queue: str, payload: dict[str, Any], **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A leading dot and a suffix: kombu's reader matches only `<stamp>_<id>.<queue>.msg`.
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as f:
                f.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc


class AtomicTransport(filesystem.Transport):
    Channel = AtomicChannel


def register() -> None:
    TRANSPORT_ALIASES[ALIAS] = f"{__name__}:AtomicTransport"
