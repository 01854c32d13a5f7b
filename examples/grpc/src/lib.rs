//! `postern-grpc-echo`: a demo and test gRPC backend, the target of Postern's REST→gRPC
//! transcoding. It serves `orders.v1.Orders` (examples/config/teams/orders/proto/orders.proto)
//! over plain HTTP/2 (h2c), with the orders kept in memory.
//!
//! - It starts with one order, `42`, in shop `acme` ([`seed_order`]).
//! - `GetOrder` answers the order (its items only with `include_items`), or `NOT_FOUND`
//!   (`order <id> not found`); id `boom` fails with `INTERNAL`, id `slow` waits 2 s and
//!   then answers order 42.
//! - `CreateOrder` needs a shop and at least one item (`INVALID_ARGUMENT` otherwise); it
//!   stores the order under a new id (`1000`, `1001`, …) with status `PENDING`, version 1,
//!   `created_at` now and `total` summed from the items when they are not given, and the
//!   request's `request_id` in `labels["request_id"]`.
//! - `UpdateOrder` replaces the fields of `order` that are set (non-default) on the order
//!   named by `order.id` and bumps its version, or answers `NOT_FOUND`.
//! - `ListOrders` streams the shop's orders in creation order, at most `page_size` of them
//!   (0 for all), only those whose status is named in `status` when it is not empty.
//!
//! Every answer carries `x-grpc-echo: 1` and `x-grpc-echo-count: N`, N counting the
//! answers of this process (this one included). A `grpc-timeout` is honoured as tonic
//! does: the call ends with `CANCELLED` ("Timeout expired") when it runs out.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use tokio::net::TcpListener;
use tonic::transport::Server;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

use pb::orders_server::{Orders, OrdersServer};
use pb::{CreateOrderRequest, GetOrderRequest, Item, ListOrdersRequest, Money, Order, UpdateOrderRequest};

/// The `orders.v1` messages, the `Orders` server (`orders_server`) and client
/// (`orders_client`), generated from the proto by the build script.
#[allow(missing_docs)]
pub mod pb {
    tonic::include_proto!("orders.v1");
}

/// The compiled `FileDescriptorSet` of `orders.proto` and its imports (`google/api/*`,
/// `google/protobuf/*`), protobuf-encoded, with source info and the `google.api.http`
/// method options (decode it with a reflection library: `prost_types` drops extensions).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/orders_descriptor.bin"));

/// The response header every answer carries, with the value `1`.
pub const ECHO_HEADER: &str = "x-grpc-echo";

/// The response header that counts the answers of this process, this one included.
pub const COUNT_HEADER: &str = "x-grpc-echo-count";

/// The shop of the seeded order 42.
pub const SEED_SHOP: &str = "acme";

/// How long `GetOrder` of id `slow` waits before answering.
pub const SLOW_DELAY: Duration = Duration::from_secs(2);

/// The first id that `CreateOrder` hands out.
const FIRST_ID: u64 = 1000;

/// Order 42, which every server starts with (in shop [`SEED_SHOP`]): customer
/// `cus_8f3kQ2xZ91ab`, two items, a total of GBP 44.98, status `PAID`, created at
/// 2026-01-01T00:00:00Z, label `channel: web`, version 7.
pub fn seed_order() -> Order {
    Order {
        id: "42".to_owned(),
        customer_id: "cus_8f3kQ2xZ91ab".to_owned(),
        items: vec![
            Item { sku: "TEA-EARLGREY-250G".to_owned(), quantity: 2, unit_price: Some(gbp(12, 990_000_000)) },
            Item { sku: "MUG-STONEWARE-BLUE".to_owned(), quantity: 1, unit_price: Some(gbp(19, 0)) },
        ],
        total: Some(gbp(44, 980_000_000)),
        status: pb::Status::Paid.into(),
        created_at: Some(prost_types::Timestamp { seconds: 1_767_225_600, nanos: 0 }),
        labels: HashMap::from([("channel".to_owned(), "web".to_owned())]),
        note: Some("leave with the neighbour".to_owned()),
        version: 7,
    }
}

fn gbp(units: i64, nanos: i32) -> Money {
    Money { currency_code: "GBP".to_owned(), units, nanos }
}

/// One stored order and the shop it was placed in.
struct Stored {
    shop: String,
    order: Order,
}

struct State {
    /// In creation order.
    orders: Vec<Stored>,
    next_id: u64,
}

impl State {
    fn find(&self, id: &str) -> Option<&Order> {
        self.orders.iter().find(|s| s.order.id == id).map(|s| &s.order)
    }
}

/// The in-memory `Orders` service.
pub struct OrdersService {
    state: Mutex<State>,
}

impl Default for OrdersService {
    fn default() -> Self {
        Self::new()
    }
}

impl OrdersService {
    /// A service holding only the seeded order 42.
    pub fn new() -> Self {
        let seed = Stored { shop: SEED_SHOP.to_owned(), order: seed_order() };
        Self { state: Mutex::new(State { orders: vec![seed], next_id: FIRST_ID }) }
    }

    /// The state; never held across an `.await`. A panic while it was held cannot leave
    /// it half-changed (every change is one assignment), so a poisoned lock is used as is.
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn get(&self, id: &str, include_items: bool) -> Result<Order, Status> {
        let mut order = self.state().find(id).cloned().ok_or_else(|| not_found(id))?;
        if !include_items {
            order.items.clear();
        }
        Ok(order)
    }
}

fn not_found(id: &str) -> Status {
    Status::not_found(format!("order {id} not found"))
}

/// The sum of the items' prices, if they all have one in the same currency.
fn total_of(items: &[Item]) -> Option<Money> {
    const NANOS: i128 = 1_000_000_000;
    let currency = &items.first()?.unit_price.as_ref()?.currency_code;
    let mut sum: i128 = 0;
    for item in items {
        let price = item.unit_price.as_ref().filter(|p| &p.currency_code == currency)?;
        sum += (i128::from(price.units) * NANOS + i128::from(price.nanos)) * i128::from(item.quantity);
    }
    Some(Money {
        currency_code: currency.clone(),
        units: i64::try_from(sum / NANOS).ok()?,
        nanos: i32::try_from(sum % NANOS).ok()?,
    })
}

fn check_status(value: i32) -> Result<(), Status> {
    pb::Status::try_from(value).map(drop).map_err(|_| Status::invalid_argument(format!("unknown status {value}")))
}

#[tonic::async_trait]
impl Orders for OrdersService {
    async fn get_order(&self, request: Request<GetOrderRequest>) -> Result<Response<Order>, Status> {
        let request = request.into_inner();
        let order = match request.id.as_str() {
            "boom" => return Err(Status::internal("order boom failed on purpose")),
            "slow" => {
                tokio::time::sleep(SLOW_DELAY).await;
                self.get("42", request.include_items)?
            }
            id => self.get(id, request.include_items)?,
        };
        Ok(Response::new(order))
    }

    async fn create_order(&self, request: Request<CreateOrderRequest>) -> Result<Response<Order>, Status> {
        let CreateOrderRequest { shop, order, request_id } = request.into_inner();
        if shop.is_empty() {
            return Err(Status::invalid_argument("shop is required"));
        }
        let mut order = order.unwrap_or_default();
        if order.items.is_empty() {
            return Err(Status::invalid_argument("an order needs at least one item"));
        }
        order.status = pb::Status::Pending.into();
        order.version = 1;
        if order.total.is_none() {
            order.total = total_of(&order.items);
        }
        if order.created_at.is_none() {
            order.created_at = Some(prost_types::Timestamp::from(SystemTime::now()));
        }
        if !request_id.is_empty() {
            order.labels.insert("request_id".to_owned(), request_id);
        }
        let mut state = self.state();
        order.id = state.next_id.to_string();
        state.next_id += 1;
        state.orders.push(Stored { shop, order: order.clone() });
        Ok(Response::new(order))
    }

    async fn update_order(&self, request: Request<UpdateOrderRequest>) -> Result<Response<Order>, Status> {
        let Some(change) = request.into_inner().order else {
            return Err(Status::invalid_argument("order is required"));
        };
        if change.status != 0 {
            check_status(change.status)?;
        }
        let mut state = self.state();
        let stored = state.orders.iter_mut().find(|s| s.order.id == change.id).ok_or_else(|| not_found(&change.id))?;
        let order = &mut stored.order;
        if !change.customer_id.is_empty() {
            order.customer_id = change.customer_id;
        }
        if !change.items.is_empty() {
            order.items = change.items;
        }
        if change.total.is_some() {
            order.total = change.total;
        }
        if change.status != 0 {
            order.status = change.status;
        }
        if change.created_at.is_some() {
            order.created_at = change.created_at;
        }
        if !change.labels.is_empty() {
            order.labels = change.labels;
        }
        if change.note.is_some() {
            order.note = change.note;
        }
        order.version += 1;
        Ok(Response::new(order.clone()))
    }

    type ListOrdersStream = futures_util::stream::Iter<std::vec::IntoIter<Result<Order, Status>>>;

    async fn list_orders(
        &self,
        request: Request<ListOrdersRequest>,
    ) -> Result<Response<Self::ListOrdersStream>, Status> {
        let request = request.into_inner();
        let limit = match usize::try_from(request.page_size) {
            Ok(0) => usize::MAX,
            Ok(n) => n,
            Err(_) => return Err(Status::invalid_argument("page_size must not be negative")),
        };
        let statuses = request
            .status
            .iter()
            .map(|name| {
                pb::Status::from_str_name(name)
                    .map(i32::from)
                    .ok_or_else(|| Status::invalid_argument(format!("unknown status {name}")))
            })
            .collect::<Result<Vec<i32>, Status>>()?;
        let orders: Vec<Result<Order, Status>> = self
            .state()
            .orders
            .iter()
            .filter(|s| s.shop == request.shop)
            .filter(|s| statuses.is_empty() || statuses.contains(&s.order.status))
            .take(limit)
            .map(|s| Ok(s.order.clone()))
            .collect();
        Ok(Response::new(futures_util::stream::iter(orders)))
    }
}

/// Serves `Orders` (a fresh [`OrdersService`]) on `listener` over h2c until `shutdown`
/// completes; then stops accepting and drains the open connections.
pub async fn serve(listener: TcpListener, shutdown: impl Future<Output = ()>) -> Result<(), tonic::transport::Error> {
    let answered = Arc::new(AtomicU64::new(0));
    let mark = tower::util::MapResponseLayer::new(move |mut response: http::Response<tonic::body::Body>| {
        let n = answered.fetch_add(1, Ordering::Relaxed) + 1;
        let headers = response.headers_mut();
        headers.insert(ECHO_HEADER, http::HeaderValue::from_static("1"));
        headers.insert(COUNT_HEADER, http::HeaderValue::from(n));
        response
    });
    Server::builder()
        .layer(mark)
        .add_service(OrdersServer::new(OrdersService::new()))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_total_is_the_sum_of_its_items() {
        let order = seed_order();
        assert_eq!(total_of(&order.items), order.total);
    }

    #[test]
    fn total_needs_one_currency() {
        let mut items = seed_order().items;
        if let Some(price) = items[1].unit_price.as_mut() {
            price.currency_code = "EUR".to_owned();
        }
        assert_eq!(total_of(&items), None);
    }

    #[test]
    fn descriptor_set_keeps_the_http_rules() {
        use prost::Message as _;
        let fds = prost_types::FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).unwrap();
        let names: Vec<&str> = fds.file.iter().map(|f| f.name()).collect();
        for name in ["orders.proto", "google/api/annotations.proto", "google/api/http.proto"] {
            assert!(names.contains(&name), "{names:?}");
        }
        // `google.api.http` (field 72295728, length-delimited) survives in the method
        // options, which prost-types decodes without their extensions: look at the bytes.
        let mut tag = Vec::new();
        prost::encoding::encode_varint((72_295_728 << 3) | 2, &mut tag);
        let contains = |needle: &[u8]| FILE_DESCRIPTOR_SET.windows(needle.len()).any(|w| w == needle);
        assert!(contains(&tag));
        for path in ["/v3/orders/{id}", "/v3/shops/{shop}/orders", "/v3/orders/{order.id}"] {
            assert!(contains(path.as_bytes()), "{path}");
        }
    }
}
