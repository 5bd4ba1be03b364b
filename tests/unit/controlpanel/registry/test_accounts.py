"""The first-run admin and who an actor is (controlpanel.registry.accounts)."""

from __future__ import annotations

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.contrib.auth.models import AnonymousUser
from django.test import RequestFactory

from controlpanel.registry import accounts

pytestmark = pytest.mark.django_db


def test_the_first_run_makes_one_admin_and_only_once() -> None:
    users = get_user_model().objects
    users.filter(is_staff=True).delete()
    password = accounts.admin_bootstrap()
    assert password and len(password) >= 16
    admin = authenticate(username="admin", password=password)
    assert admin is not None and admin.is_superuser
    assert accounts.admin_bootstrap() is None
    assert users.filter(is_staff=True).count() == 1


def test_a_staff_user_already_there_means_no_new_admin() -> None:
    get_user_model().objects.create_user(username="ops", password="x" * 20, is_staff=True)
    assert accounts.admin_bootstrap() is None
    assert not get_user_model().objects.filter(username="admin").exists()


def test_an_actor_is_the_logged_in_user_or_the_admin_token() -> None:
    request = RequestFactory().get("/")
    assert accounts.request_actor(request) == accounts.ADMIN_TOKEN_ACTOR  # no user at all
    request.user = AnonymousUser()
    assert accounts.request_actor(request) == "admin-token"
    request.user = get_user_model().objects.create_user(username="ann")
    assert accounts.request_actor(request) == "user:ann"
    assert accounts.request_actor(request, surface="admin") == "admin:ann"
