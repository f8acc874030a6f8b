"""Project-wide REST glue: the exception handler that keeps user mistakes out of the 500s."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db.models import ProtectedError, RestrictedError
from rest_framework import exceptions, status
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
