"""Project-wide REST glue: the exception handler that keeps user mistakes out of the 500s, and
the pagination every list endpoint uses."""

from __future__ import annotations

from django.conf import settings
from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import exceptions, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.response import Response
from rest_framework.serializers import as_serializer_error
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict) -> Response | None:
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(as_serializer_error(exc))
    if isinstance(exc, ProtectedError | RestrictedError):
        names = sorted(
            {str(obj) for obj in exc.protected_objects if obj is not None}
            if isinstance(exc, ProtectedError)
            else {str(obj) for obj in exc.restricted_objects}
        )
        return Response(
            {"detail": f"Still in use by: {', '.join(names[:10])}. Remove those first."},
            status=status.HTTP_409_CONFLICT,
        )
    return drf_exception_handler(exc, context)


class CappedLimitOffsetPagination(LimitOffsetPagination):
    """`?limit=&offset=` pagination whose `limit` is capped at `API_MAX_PAGE_SIZE`: a larger one
    (however many digits) answers a page of the cap, never a query the database cannot run."""

    @property
    def max_limit(self) -> int:  # type: ignore[override]
        return settings.API_MAX_PAGE_SIZE
