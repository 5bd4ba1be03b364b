"""The admin and worker-agent JSON API (django-ninja; the docs are at /api/docs).

Lives here: ``site`` (the NinjaAPI, its auth and its error handlers), and one router module
per domain. Endpoints are thin: authenticate, call one service, shape the answer.

May import: every domain app, ``routing`` (policies, the error builder) and Django. Never
the console: the API and the console are independent peers on top.
"""
