"""The API's token endpoints: username and password in, a hashed, expiring token out; and its
revocation (this token, or every token of the user).

Tokens are django-rest-knox's: only a digest is stored, each expires after `REST_KNOX`'s
TOKEN_TTL (API_TOKEN_TTL_HOURS). Failed attempts count towards django-axes' lockout exactly as the
login pages' do, so the endpoint cannot be used to guess passwords faster than the pages.
"""

from __future__ import annotations

from django.contrib.auth import authenticate
from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from knox.views import LoginView, LogoutAllView, LogoutView
from rest_framework import serializers, status
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response


class CredentialsSerializer(serializers.Serializer):
    username = serializers.CharField()
    password = serializers.CharField(style={"input_type": "password"}, trim_whitespace=False)


class TokenLoginView(LoginView):
    """POST username and password; the answer holds a new token and its expiry."""

    authentication_classes: list = []
    permission_classes = [AllowAny]
    serializer_class = CredentialsSerializer

    @extend_schema(
        summary="Sign in: a token for this API",
        request=CredentialsSerializer,
        responses={
            200: inline_serializer("Token", {"token": serializers.CharField(),
                                             "expiry": serializers.DateTimeField()}),
            400: OpenApiResponse(description="Missing fields, or wrong username or password."),
            429: OpenApiResponse(description="Too many failed attempts: locked out for a while."),
        },
    )
    def post(self, request: Request, format: str | None = None) -> Response:
        credentials = CredentialsSerializer(data=request.data)
        if not credentials.is_valid():
            return Response(credentials.errors, status=status.HTTP_400_BAD_REQUEST)
        # The Django request, not DRF's wrapper: django-axes marks a locked-out request on it,
        # and its middleware turns that mark into the lockout response.
        user = authenticate(request._request, **credentials.validated_data)
        if user is None or not user.is_active:
            # Answered, not raised: a raised error would roll the request's transaction back
            # (ATOMIC_REQUESTS) and with it django-axes' record of the failed attempt.
            return Response(
                {"non_field_errors": ["Unable to log in with the provided credentials."]},
                status=status.HTTP_400_BAD_REQUEST,
            )
        request.user = user
        return super().post(request, format)


_REVOKED = {204: OpenApiResponse(description="Revoked.")}


class TokenLogoutView(LogoutView):
    """POST with a token: that token is revoked."""

    @extend_schema(summary="Revoke this token", request=None, responses=_REVOKED)
    def post(self, request: Request, format: str | None = None) -> Response:
        return super().post(request, format)


class TokenLogoutAllView(LogoutAllView):
    """POST with a token: every token of its user is revoked."""

    @extend_schema(summary="Revoke all your tokens", request=None, responses=_REVOKED)
    def post(self, request: Request, format: str | None = None) -> Response:
        return super().post(request, format)
