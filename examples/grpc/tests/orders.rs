//! Starts the server on 127.0.0.1:0 (in-process, and as the binary) and calls it with the
//! generated tonic client.

#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::io::BufRead as _;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use postern_grpc_echo::pb::orders_client::OrdersClient;
use postern_grpc_echo::pb::{self, CreateOrderRequest, GetOrderRequest, Item, ListOrdersRequest, Money, Order};
use postern_grpc_echo::{COUNT_HEADER, ECHO_HEADER, seed_order};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::Code;
use tonic::transport::Channel;

/// A server on an ephemeral port, stopped when dropped.
struct Server {
    addr: SocketAddr,
    _stop: oneshot::Sender<()>,
}

impl Server {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(postern_grpc_echo::serve(listener, async {
            let _ = stopped.await;
        }));
        Self { addr, _stop: stop }
    }

    async fn client(&self) -> OrdersClient<Channel> {
        OrdersClient::connect(format!("http://{}", self.addr)).await.unwrap()
    }
}

fn get(id: &str, include_items: bool) -> GetOrderRequest {
    GetOrderRequest { id: id.to_owned(), include_items }
}

fn new_order(skus: &[&str]) -> Order {
    let items = skus
        .iter()
        .map(|sku| Item {
            sku: (*sku).to_owned(),
            quantity: 3,
            unit_price: Some(Money { currency_code: "EUR".to_owned(), units: 1, nanos: 500_000_000 }),
        })
        .collect();
    Order { customer_id: "cus_new".to_owned(), items, ..Order::default() }
}

async fn list(client: &mut OrdersClient<Channel>, shop: &str, page_size: i32, status: &[&str]) -> Vec<Order> {
    let request = ListOrdersRequest {
        shop: shop.to_owned(),
        page_size,
        status: status.iter().map(|s| (*s).to_owned()).collect(),
    };
    let mut stream = client.list_orders(request).await.unwrap().into_inner();
    let mut orders = Vec::new();
    while let Some(order) = stream.message().await.unwrap() {
        orders.push(order);
    }
    orders
}

#[tokio::test]
async fn get_order_found_and_not_found() {
    let server = Server::start().await;
    let mut client = server.client().await;

    let response = client.get_order(get("42", true)).await.unwrap();
    assert_eq!(response.metadata().get(ECHO_HEADER).unwrap(), "1");
    assert_eq!(response.metadata().get(COUNT_HEADER).unwrap(), "1");
    let order = response.into_inner();
    assert_eq!(order, seed_order());
    assert_eq!(order.customer_id, "cus_8f3kQ2xZ91ab");
    assert_eq!(order.items.len(), 2);
    assert_eq!(order.total, Some(Money { currency_code: "GBP".to_owned(), units: 44, nanos: 980_000_000 }));
    assert_eq!(order.status(), pb::Status::Paid);
    assert_eq!(order.version, 7);

    let without_items = client.get_order(get("42", false)).await.unwrap().into_inner();
    assert!(without_items.items.is_empty());
    assert_eq!(without_items.id, "42");

    let missing = client.get_order(get("nope", true)).await.unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
    assert_eq!(missing.message(), "order nope not found");
    assert_eq!(missing.metadata().get(ECHO_HEADER).unwrap(), "1");
    assert_eq!(missing.metadata().get(COUNT_HEADER).unwrap(), "3");

    let boom = client.get_order(get("boom", true)).await.unwrap_err();
    assert_eq!(boom.code(), Code::Internal);
}

#[tokio::test]
async fn grpc_timeout_cuts_a_slow_call() {
    let server = Server::start().await;
    let mut client = server.client().await;
    let mut request = tonic::Request::new(get("slow", true));
    request.set_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let status = client.get_order(request).await.unwrap_err();
    assert!(started.elapsed() < Duration::from_millis(1500), "{:?}", started.elapsed());
    assert_eq!(status.code(), Code::Cancelled, "{status:?}");
}

#[tokio::test]
async fn create_update_and_list_orders() {
    let server = Server::start().await;
    let mut client = server.client().await;

    let empty =
        CreateOrderRequest { shop: "acme".to_owned(), order: Some(Order::default()), request_id: String::new() };
    assert_eq!(client.create_order(empty).await.unwrap_err().code(), Code::InvalidArgument);

    let request = CreateOrderRequest {
        shop: "acme".to_owned(),
        order: Some(new_order(&["SOCK-RED", "SOCK-BLUE"])),
        request_id: "req-1".to_owned(),
    };
    let created = client.create_order(request).await.unwrap().into_inner();
    assert_eq!(created.id, "1000");
    assert_eq!(created.status(), pb::Status::Pending);
    assert_eq!(created.version, 1);
    assert_eq!(created.labels.get("request_id").map(String::as_str), Some("req-1"));
    assert_eq!(created.total, Some(Money { currency_code: "EUR".to_owned(), units: 9, nanos: 0 }));
    assert!(created.created_at.is_some());

    let other =
        CreateOrderRequest { shop: "globex".to_owned(), order: Some(new_order(&["HAT"])), request_id: String::new() };
    let other = client.create_order(other).await.unwrap().into_inner();
    assert_eq!(other.id, "1001");
    assert!(!other.labels.contains_key("request_id"));

    let fetched = client.get_order(get("1000", true)).await.unwrap().into_inner();
    assert_eq!(fetched, created);

    let ids = |orders: Vec<Order>| orders.into_iter().map(|o| o.id).collect::<Vec<_>>();
    assert_eq!(ids(list(&mut client, "acme", 0, &[]).await), ["42", "1000"]);
    assert_eq!(ids(list(&mut client, "acme", 1, &[]).await), ["42"]);
    assert_eq!(ids(list(&mut client, "acme", 0, &["PENDING"]).await), ["1000"]);
    assert_eq!(ids(list(&mut client, "acme", 0, &["PAID", "PENDING"]).await), ["42", "1000"]);
    assert_eq!(ids(list(&mut client, "globex", 0, &[]).await), ["1001"]);
    assert!(list(&mut client, "nowhere", 0, &[]).await.is_empty());
    let bad = ListOrdersRequest { shop: "acme".to_owned(), page_size: 0, status: vec!["LOST".to_owned()] };
    assert_eq!(client.list_orders(bad).await.unwrap_err().code(), Code::InvalidArgument);

    let change = Order {
        id: "42".to_owned(),
        status: pb::Status::Shipped.into(),
        note: Some("shipped by courier".to_owned()),
        ..Order::default()
    };
    let updated = client.update_order(pb::UpdateOrderRequest { order: Some(change) }).await.unwrap().into_inner();
    assert_eq!(updated.version, 8);
    assert_eq!(updated.status(), pb::Status::Shipped);
    assert_eq!(updated.note.as_deref(), Some("shipped by courier"));
    assert_eq!(updated.customer_id, "cus_8f3kQ2xZ91ab");
    assert_eq!(updated.items.len(), 2);

    let unknown = Order { id: "7".to_owned(), ..Order::default() };
    let status = client.update_order(pb::UpdateOrderRequest { order: Some(unknown) }).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(status.message(), "order 7 not found");
}

#[tokio::test]
async fn binary_prints_its_address_and_serves() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_postern-grpc-echo"))
        .args(["--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim_end().strip_prefix("listening on ").unwrap().to_owned();
    let result = async {
        let mut client = OrdersClient::connect(format!("http://{addr}")).await?;
        Ok::<_, Box<dyn std::error::Error>>(client.get_order(get("42", false)).await?.into_inner())
    }
    .await;
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(result.unwrap().id, "42");
}
