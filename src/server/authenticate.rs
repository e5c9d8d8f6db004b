//! Authentication, as a tower layer. Every Flight method but `Handshake` is authenticated here,
//! and the caller's role checked against what the role table (`crate::auth::required_role`)
//! says the method needs, before the request's body is read: a refused call costs nothing.
//!
//! The caller ([`Principal`]) goes to the handler in the request's extensions, with where the
//! call came from ([`Origin`]: `Handshake` counts failed logins by it). `DoAction` checks each
//! action's own role in the same table once it has read which action it is.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::{Either, Ready, ready};
use tonic::Status;
use tonic::body::Body;

use super::method::{Method, method_of};
use super::peer::ConnectionInfo;
use crate::auth::{Auth, Operation, Presented, Principal};
use crate::error::Error;
use crate::flight::Call;

/// The layer: authenticates each request with `auth`.
#[derive(Debug, Clone)]
pub(super) struct Authenticate {
    pub(super) auth: Auth,
}

impl<S> tower::Layer<S> for Authenticate {
    type Service = Authenticated<S>;

    fn layer(&self, inner: S) -> Authenticated<S> {
        Authenticated {
            inner,
            auth: self.auth.clone(),
        }
    }
}

/// A service that only authorized callers reach ([`Authenticate`]).
#[derive(Debug, Clone)]
pub(super) struct Authenticated<S> {
    inner: S,
    auth: Auth,
}

impl<S> tower::Service<http::Request<Body>> for Authenticated<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Either<Ready<Result<http::Response<Body>, Infallible>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        let connection = request.extensions().get::<ConnectionInfo>().cloned();
        if let Some(connection) = &connection {
            request.extensions_mut().insert(connection.origin());
        }
        let method = method_of(&request);
        if method == Method::Handshake {
            // How callers authenticate: the handler reads their credentials.
            return Either::Right(self.inner.call(request));
        }
        match authorize(&self.auth, method, &request, connection.as_ref()) {
            Ok(principal) => {
                if let Some(call) = request.extensions().get::<Arc<Call>>() {
                    call.set_principal(Arc::clone(&principal.name));
                }
                request.extensions_mut().insert(principal);
                Either::Right(self.inner.call(request))
            }
            Err(error) => Either::Left(ready(Ok(Status::from(error).into_http()))),
        }
    }
}

/// The caller of `request`, allowed to call `method`.
fn authorize(
    auth: &Auth,
    method: Method,
    request: &http::Request<Body>,
    connection: Option<&ConnectionInfo>,
) -> Result<Principal, Error> {
    let presented = Presented {
        authorization: request
            .headers()
            .get(http::header::AUTHORIZATION)
            .map(http::HeaderValue::as_bytes),
        certificate: connection.and_then(|c| c.certificate.as_deref()),
        origin: connection.map(ConnectionInfo::origin),
    };
    let principal = auth.authenticate(&presented)?;
    principal.authorize(Operation::Method(method))?;
    Ok(principal)
}
