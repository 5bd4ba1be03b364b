"""The registry: every model and migration of the control plane, and what all domains share.

Lives here: the models (app label ``controlpanel``, so tables and migration history are
those of the single app this once was), the event log's writer, the one error type the
services raise, the signal a committed routing change sends, accounts (the bootstrap admin,
who an actor is) and sealed secrets.

May import: Django and the standard library. Nothing from the other control-plane apps,
``routing`` or ``simulator``: every other app builds on this one.
"""
