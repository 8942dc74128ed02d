//! API errors: `{"error": {"type", "message"}}` with the status of their type.

use axum::Json;
use axum::extract::rejection::{JsonRejection, QueryRejection};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_schema::api::{ErrorBody, ErrorDetail, ErrorType};

use crate::{inbox, request, runner, store};

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub kind: ErrorType,
    pub message: String,
}

impl ApiError {
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(ErrorType::BadRequest, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorType::NotFound, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        if status.is_server_error() {
            tracing::error!(message = %self.message, "request failed");
        }
        let body = ErrorBody {
            error: ErrorDetail {
                kind: self.kind,
                message: self.message,
            },
        };
        (status, Json(body)).into_response()
    }
}

impl From<store::Error> for ApiError {
    fn from(e: store::Error) -> Self {
        match e {
            store::Error::SessionNotFound(_) => Self::not_found(e.to_string()),
            store::Error::SessionDeleted(_) | store::Error::SessionExists(_) => {
                Self::new(ErrorType::Conflict, e.to_string())
            }
            store::Error::Projection { .. } => Self::new(ErrorType::Unprocessable, e.to_string()),
            _ if e.is_unavailable() => Self::new(ErrorType::Unavailable, e.to_string()),
            _ => Self::new(ErrorType::Internal, e.to_string()),
        }
    }
}

impl From<inbox::Error> for ApiError {
    fn from(e: inbox::Error) -> Self {
        match e {
            inbox::Error::Conflict { .. } | inbox::Error::NotPending { .. } => {
                Self::new(ErrorType::Conflict, e.to_string())
            }
            inbox::Error::Invalid(_) => Self::new(ErrorType::Unprocessable, e.to_string()),
            inbox::Error::NotFound { .. } => Self::not_found(e.to_string()),
            inbox::Error::Store(e) => e.into(),
        }
    }
}

impl From<request::Error> for ApiError {
    fn from(e: request::Error) -> Self {
        match e {
            request::Error::Unknown(_) => Self::not_found(e.to_string()),
            request::Error::WrongKind { .. } | request::Error::Answered(_) => {
                Self::new(ErrorType::Conflict, e.to_string())
            }
            request::Error::Store(e) => e.into(),
        }
    }
}

impl From<runner::Error> for ApiError {
    fn from(e: runner::Error) -> Self {
        match e {
            runner::Error::Store(store) if store.is_unavailable() => {
                Self::new(ErrorType::Unavailable, store.to_string())
            }
            e => Self::new(ErrorType::Internal, e.to_string()),
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(e: JsonRejection) -> Self {
        match e {
            JsonRejection::BytesRejection(_) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Self::new(
                    ErrorType::PayloadTooLarge,
                    "the body is over the size limit",
                )
            }
            other => Self::bad_request(other.body_text()),
        }
    }
}

impl From<QueryRejection> for ApiError {
    fn from(e: QueryRejection) -> Self {
        Self::bad_request(e.body_text())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use diesel::result::{DatabaseErrorKind, Error as Db};

    use super::*;

    #[test]
    fn a_database_out_of_reach_is_a_503_and_a_broken_row_a_500() {
        let closed = || {
            store::Error::Database(Db::DatabaseError(
                DatabaseErrorKind::ClosedConnection,
                Box::new("server closed the connection unexpectedly".to_owned()),
            ))
        };
        for unavailable in [
            closed(),
            store::Error::CommitFailed("commit failed: connection lost".into()),
            store::Error::WriterGone,
        ] {
            assert_eq!(ApiError::from(unavailable).kind, ErrorType::Unavailable);
        }
        let through_the_runner = runner::Error::Store(Arc::new(closed()));
        assert_eq!(
            ApiError::from(through_the_runner).kind,
            ErrorType::Unavailable
        );
        assert_eq!(
            ApiError::from(store::Error::Corrupt("claim phase".into())).kind,
            ErrorType::Internal
        );
        assert_eq!(
            ApiError::from(runner::Error::Config("no agent".into())).kind,
            ErrorType::Internal
        );
    }
}
