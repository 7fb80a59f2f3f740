//! Error answers (RFC 9457): every failure is `application/problem+json` naming the field at
//! fault, and map syscalls run off the async workers.

use axum::{
    extract::rejection::{JsonRejection, QueryRejection},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};

use crate::datapath::MapsError;

/// An error answer: `application/problem+json` with a status, a title and a detail that names
/// the field at fault, plus any extension members.
#[derive(Debug)]
pub struct Problem(pub(super) Box<ProblemDetails>);

#[derive(Debug)]
pub(super) struct ProblemDetails {
    pub(super) status: StatusCode,
    pub(super) detail: String,
    extra: serde_json::Map<String, serde_json::Value>,
    pub(super) headers: HeaderMap,
}

pub const PROBLEM_JSON: &str = "application/problem+json";

impl Problem {
    pub fn new(status: StatusCode, detail: impl Into<String>) -> Self {
        Self(Box::new(ProblemDetails {
            status,
            detail: detail.into(),
            extra: serde_json::Map::new(),
            headers: HeaderMap::new(),
        }))
    }

    pub(super) fn bad_request(field: &str, detail: impl std::fmt::Display) -> Self {
        Self::new(StatusCode::BAD_REQUEST, format!("{field}: {detail}")).with("field", field)
    }

    pub(super) fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> Self {
        self.0.extra.insert(key.to_owned(), value.into());
        self
    }

    pub(super) fn internal(what: &str, error: &dyn std::error::Error) -> Self {
        let detail = format!("{what}: {}", crate::errors::error_chain(error));
        tracing::error!("{detail}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, detail)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let problem = *self.0;
        let mut body = serde_json::Map::new();
        body.insert(
            "title".into(),
            problem
                .status
                .canonical_reason()
                .unwrap_or("Error")
                .to_owned()
                .into(),
        );
        body.insert("status".into(), problem.status.as_u16().into());
        body.insert("detail".into(), problem.detail.into());
        body.extend(problem.extra);
        let mut response = (
            problem.status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON))],
            serde_json::Value::Object(body).to_string(),
        )
            .into_response();
        response.headers_mut().extend(problem.headers);
        response
    }
}

/// A body that is not the JSON expected is a bad request (400) whether it fails to parse or
/// to fit the fields; axum's text names the field. A wrong content type keeps its 415.
pub(super) fn json_rejection(rejection: JsonRejection) -> Problem {
    let status = match &rejection {
        JsonRejection::JsonDataError(_) | JsonRejection::JsonSyntaxError(_) => {
            StatusCode::BAD_REQUEST
        }
        other => other.status(),
    };
    Problem::new(status, rejection.body_text())
}

pub(super) fn query_rejection(rejection: QueryRejection) -> Problem {
    Problem::new(StatusCode::BAD_REQUEST, rejection.body_text())
}

pub(super) async fn not_found() -> Problem {
    Problem::new(StatusCode::NOT_FOUND, "no such endpoint")
}

/// Runs map syscalls (a list change rewrites the LPM tries, a scrape walks the flow table)
/// off the runtime's worker threads.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Problem> + Send + 'static,
) -> Result<T, Problem> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Problem::internal("the request's task failed", &e))?
}

pub(super) fn maps_problem(error: MapsError) -> Problem {
    Problem::internal("reading the kernel maps", &error)
}
