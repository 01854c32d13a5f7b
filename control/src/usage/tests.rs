use std::collections::BTreeMap;

use postern_model::credentials::Credentials;
use postern_model::protocol::UsageAck;
use postern_model::usage::{CallerKind, LATENCY_BUCKETS, NodeCounters, Row, Window, latency_bucket};
use postern_model::{Plan, Quota, QuotaMode};
use rusqlite::{Connection, params};

use super::*;

/// A fresh usage store for one test: a SQLite file in a temporary directory, or a
/// PostgreSQL database of its own on 127.0.0.1:5432, dropped after the test.
enum TestDb {
    Sqlite(tempfile::TempDir),
    Postgres(String),
}

const PG_ADMIN: &str = "postgres://postgres@127.0.0.1:5432/postgres";

impl TestDb {
    fn sqlite() -> TestDb {
        TestDb::Sqlite(tempfile::tempdir().unwrap())
    }

    fn postgres() -> TestDb {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
        let name = format!("usage_unit_{}_{n}_{nanos}", std::process::id());
        let mut admin = postgres::Client::connect(PG_ADMIN, postgres::NoTls).unwrap();
        admin.batch_execute(&format!("CREATE DATABASE {name}")).unwrap();
        TestDb::Postgres(name)
    }

    fn open(&self) -> UsageStore {
        match self {
            TestDb::Sqlite(dir) => UsageStore::open(&dir.path().join("usage.db")).unwrap(),
            TestDb::Postgres(name) => {
                UsageStore::open_postgres(&format!("postgres://postgres@127.0.0.1:5432/{name}")).unwrap()
            }
        }
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if let TestDb::Postgres(name) = self
            && let Ok(mut admin) = postgres::Client::connect(PG_ADMIN, postgres::NoTls)
        {
            let _ = admin.batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"));
        }
    }
}

/// Runs each test (a `fn(&TestDb)`) on both engines: `<name>::sqlite`, `<name>::postgres`.
macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[test]
                fn sqlite() {
                    super::$name(&super::TestDb::sqlite());
                }
                #[test]
                fn postgres() {
                    super::$name(&super::TestDb::postgres());
                }
            }
        )*
    };
}

on_both_engines!(
    a_window_is_added_once_however_often_it_comes,
    rows_group_by_minute_and_day_and_a_team_sees_its_routes,
    gaps_below_the_highest_number_are_asked_for_until_filled,
    parts_apply_once_whichever_way_they_come_and_a_window_is_in_once_all_are,
    a_period_is_final_once_ended_and_complete_and_a_late_window_is_held_for_the_platform,
    a_retired_node_sends_nothing_past_its_last_window,
    a_hard_quota_flags_its_caller_and_bills_no_overshoot,
    an_overage_quota_warns_and_bills_everything,
    a_node_may_report_only_what_it_could_have_counted,
    a_late_window_of_a_period_already_over_flags_nothing,
    a_total_past_i64_max_is_refused_never_clamped,
    a_team_reads_at_most_31_days,
    batches_applied_as_a_group_are_answered_each_as_if_alone,
    the_group_commit_answers_every_request_and_adds_each_window_once,
    a_routes_p999_is_the_bound_of_the_bucket_it_falls_in,
);

fn row(caller: &str, route: &str, status: [u64; 5], ms: u64) -> Row {
    let mut latency = vec![0; LATENCY_BUCKETS];
    latency[latency_bucket(ms * 1000)] = status.iter().sum();
    Row {
        caller: caller.into(),
        kind: CallerKind::Key,
        product: "search".into(),
        route: route.into(),
        status,
        latency,
        latency_us: ms * 1000 * status.iter().sum::<u64>(),
    }
}

fn window(node: &str, seq: u64, start: u64, rows: Vec<Row>) -> Window {
    Window::new(node.into(), seq, start, false, rows)
}

// 2026-12-01T00:00:00Z.
const DEC: u64 = 1_796_083_200;

fn a_window_is_added_once_however_often_it_comes(db: &TestDb) {
    let store = db.open();
    let w1 = window("a", 1, DEC, vec![row("k1", "search/query", [0, 7, 1, 2, 0], 4)]);
    let w2 = window("a", 2, DEC + 10, vec![row("k1", "search/query", [0, 3, 0, 0, 1], 40)]);
    let ack = |applied, duplicates| UsageAck { applied, duplicates, missing: Vec::new() };
    assert_eq!(store.apply(std::slice::from_ref(&w1), DEC, &Quotas::default()).unwrap(), ack(1, 0));
    assert_eq!(store.apply(&[w1.clone(), w2], DEC, &Quotas::default()).unwrap(), ack(1, 1));
    assert_eq!(store.apply(std::slice::from_ref(&w1), DEC, &Quotas::default()).unwrap(), ack(0, 1));
    // Other contents under a known (node, seq): refused whole.
    let mut other = w1;
    other.rows[0].status[1] += 1;
    other.rows[0].latency[latency_bucket(4000)] += 1;
    let w3 = window("a", 3, DEC + 20, vec![row("k1", "search/query", [0, 1, 0, 0, 0], 4)]);
    assert!(matches!(store.apply(&[w3, other], DEC, &Quotas::default()), Err(ApplyError::Conflict { seq: 1, .. })));
    let t = store.totals("2026-12", None).unwrap();
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].billable, t[0].calls), (11, 14));
    let q = Query { caller: None, product: None, team: None, from: DEC, to: DEC + 60, by: By::Route };
    let rows = store.query(&q).unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].calls, rows[0].billable, rows[0].at.clone()), (14, 11, None));
    assert!(rows[0].latency_ms.p99 > 30.0, "{:?}", rows[0].latency_ms);
    let nodes = store.nodes().unwrap();
    assert_eq!((nodes[0].windows, nodes[0].last_seq, nodes[0].missing, nodes[0].duplicates), (2, 2, 0, 2));
    // Reopened, everything is still there.
    drop(store);
    let store = db.open();
    assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 11);
}

fn rows_group_by_minute_and_day_and_a_team_sees_its_routes(db: &TestDb) {
    let store = db.open();
    let windows = vec![
        window(
            "a",
            1,
            DEC,
            vec![row("k1", "search/query", [0, 1, 0, 0, 0], 1), row("k2", "pay/charge", [0, 2, 0, 0, 0], 1)],
        ),
        window("a", 2, DEC + 60, vec![row("k1", "search/query", [0, 4, 0, 0, 0], 1)]),
        window("b", 5, DEC - 10, vec![row("k1", "search/query", [0, 8, 0, 0, 0], 1)]),
    ];
    store.apply(&windows, DEC, &Quotas::default()).unwrap();
    let all = |by| Query { caller: Some("k1".into()), product: None, team: None, from: DEC, to: DEC + 120, by };
    let by_minute = store.query(&all(By::Minute)).unwrap();
    assert_eq!(by_minute.iter().map(|r| r.calls).collect::<Vec<_>>(), vec![1, 4]);
    assert_eq!(by_minute[0].at.as_deref(), Some("2026-12-01T00:00:00Z"));
    let by_day = store.query(&all(By::Day)).unwrap();
    assert_eq!(by_day.iter().map(|r| r.calls).collect::<Vec<_>>(), vec![5]);
    let mut q = all(By::Route);
    q.caller = None;
    q.team = Some("pay".into());
    assert_eq!(store.query(&q).unwrap().iter().map(|r| r.route.as_str()).collect::<Vec<_>>(), vec!["pay/charge"]);
    // The November window is November's.
    assert_eq!(store.totals("2026-11", Some("k1")).unwrap()[0].billable, 8);
    assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 5);
    // Node b's windows 1..4 never came.
    assert_eq!(store.nodes().unwrap()[1].missing, 4);
}

fn gaps_below_the_highest_number_are_asked_for_until_filled(db: &TestDb) {
    let store = db.open();
    let w = |seq| window("a", seq, DEC + seq * 10, vec![row("k1", "search/query", [0, 1, 0, 0, 0], 1)]);
    // `now` is after the last window: a window may not start in the future.
    let missing = |ack: UsageAck| ack.missing.iter().map(|m| (m.from, m.to)).collect::<Vec<_>>();
    assert_eq!(missing(store.apply(&[w(1), w(2)], DEC + 100, &Quotas::default()).unwrap()), vec![]);
    // 3..5 and 7 never came.
    assert_eq!(missing(store.apply(&[w(6), w(8)], DEC + 100, &Quotas::default()).unwrap()), vec![(3, 5), (7, 7)]);
    assert_eq!(
        missing(store.apply(&[w(4), w(9)], DEC + 100, &Quotas::default()).unwrap()),
        vec![(3, 3), (5, 5), (7, 7)]
    );
    assert_eq!(missing(store.apply(&[w(3), w(5), w(7)], DEC + 100, &Quotas::default()).unwrap()), vec![]);
    assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 9);
    assert_eq!(store.nodes().unwrap()[0].missing, 0);
}

fn parts_apply_once_whichever_way_they_come_and_a_window_is_in_once_all_are(db: &TestDb) {
    let store = db.open();
    let q = Quotas::default();
    let whole = |seq| {
        window(
            "a",
            seq,
            DEC + seq * 10,
            vec![row("k2", "search/query", [0, 2, 0, 0, 0], 1), row("k1", "search/query", [0, 1, 0, 0, 0], 1)],
        )
    };
    let missing = |ack: UsageAck| ack.missing.iter().map(|m| (m.from, m.to)).collect::<Vec<_>>();
    // Window 1 whole (HTTP); window 2 by parts (Kafka), one part late.
    assert_eq!(store.apply(&[whole(1)], DEC, &q).unwrap().applied, 1);
    let parts = whole(2).split();
    assert_eq!(parts.len(), 2);
    assert_eq!(missing(store.apply(&[parts[1].clone()], DEC, &q).unwrap()), vec![(2, 2)]);
    assert_eq!(missing(store.apply(&[whole(3).split()[0].clone()], DEC, &q).unwrap()), vec![(2, 3)]);
    assert_eq!(store.nodes().unwrap()[0].missing, 2);
    // The whole window 2 sent again adds only its missing part.
    let ack = store.apply(&[whole(2)], DEC, &q).unwrap();
    assert_eq!((ack.applied, ack.duplicates, missing(ack)), (1, 0, vec![(3, 3)]));
    // Window 1's parts, as Kafka carries them: duplicates.
    let ack = store.apply(&whole(1).split(), DEC, &q).unwrap();
    assert_eq!((ack.applied, ack.duplicates), (0, 2));
    let ack = store.apply(&whole(3).split(), DEC, &q).unwrap();
    assert_eq!((ack.applied, ack.duplicates, missing(ack)), (1, 1, vec![]));
    let billed = |k| store.totals("2026-12", Some(k)).unwrap()[0].billable;
    assert_eq!((billed("k1"), billed("k2")), (3, 6));
    let n = &store.nodes().unwrap()[0];
    assert_eq!((n.windows, n.last_seq, n.missing, n.duplicates), (3, 3, 0, 3));
}

#[test]
fn a_store_of_whole_windows_is_rewritten_as_parts() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("usage.db");
    let w = window(
        "a",
        1,
        DEC,
        vec![row("k2", "search/query", [0, 2, 0, 0, 0], 1), row("k1", "search/query", [0, 1, 0, 0, 0], 1)],
    );
    {
        // The table as it was before parts.
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE applied (
                node TEXT NOT NULL, seq INTEGER NOT NULL, start INTEGER NOT NULL,
                recovered INTEGER NOT NULL, calls INTEGER NOT NULL, received INTEGER NOT NULL,
                raw BLOB NOT NULL, PRIMARY KEY (node, seq)) WITHOUT ROWID;",
        )
        .unwrap();
        conn.execute(
            "INSERT INTO applied VALUES ('a', 1, ?1, 0, 3, ?1, ?2)",
            params![DEC as i64, serde_json::to_vec(&w).unwrap()],
        )
        .unwrap();
    }
    let store = UsageStore::open(&path).unwrap();
    let ack = store.apply(std::slice::from_ref(&w), DEC, &Quotas::default()).unwrap();
    assert_eq!((ack.applied, ack.duplicates), (0, 1));
    let n = &store.nodes().unwrap()[0];
    assert_eq!((n.windows, n.last_seq), (1, 1));
}

fn a_period_is_final_once_ended_and_complete_and_a_late_window_is_held_for_the_platform(db: &TestDb) {
    let store = db.open();
    let none = Quotas::default();
    let w = |seq, start| window("a", seq, start, vec![row("k1", "search/query", [0, 2, 0, 1, 0], 1)]);
    let after = DEC + CLOSE_GRACE_S;
    store.apply(&[w(1, DEC - 20), w(3, DEC + 10)], DEC, &none).unwrap();
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(!r.is_final && r.blocking.len() == 1 && r.blocking[0].contains("node a has not reported"), "{r:?}");
    // The node's own counts cover number 3: window 2 is missing.
    store.put_counters(&own("a", 3, &[("k1", [0, 4, 0, 2, 0])], &[]), DEC).unwrap();
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(!r.is_final && r.blocking.len() == 1 && r.blocking[0].contains("lacks windows 2..2"), "{r:?}");
    assert!(store.export("2026-11").unwrap().is_err());
    store.apply(&[w(2, DEC - 10)], DEC, &none).unwrap();
    // Not before the period's end and its grace.
    assert!(!store.reconcile("2026-11", after - 1).unwrap().unwrap().is_final);
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(r.is_final, "{r:?}");
    assert_eq!((r.billable, r.callers, r.nodes[0].windows, r.nodes[0].calls), (4, 1, 2, 6));
    assert_eq!((r.nodes[0].own_calls, r.nodes[0].corrected, r.nodes[0].counted_less), (Some(6), 0, 0));
    let export = store.export("2026-11").unwrap().unwrap();
    assert_eq!((export.len(), export[0].billable, export[0].status.s4), (1, 4, 2));
    // December is still open.
    assert!(!store.reconcile("2026-12", after).unwrap().unwrap().is_final);

    // Node c lost window 2 for good (the store asked, the spool no longer held it):
    // its own counts stand for it, as a correction.
    let c = |seq, start, ok| window("c", seq, start, vec![row("k3", "search/query", [0, ok, 0, 0, 0], 1)]);
    store.apply(&[c(1, DEC - 20, 2), c(3, DEC + 10, 1)], DEC, &none).unwrap();
    // November is final: its window is held, never added on its own.
    assert!(store.is_final("2026-11").unwrap());
    assert_eq!(store.totals("2026-11", Some("k3")).unwrap().len(), 0);
    let held = |state: &str, by: Option<&str>| Held {
        period: "2026-11".into(),
        state: state.into(),
        parts: 1,
        reports: 0,
        calls: 2,
        nodes: vec!["c".into()],
        decided_by: by.map(str::to_owned),
        decided_at: by.map(|_| rfc3339(DEC)),
    };
    assert_eq!(store.held().unwrap(), vec![held("held", None)]);
    // The platform applies it: added as it would have been, the period reopened.
    assert_eq!(store.decide_held("2026-11", Decision::Apply, "ops", DEC, &none).unwrap().parts, 1);
    assert_eq!(store.held().unwrap(), vec![held("applied", Some("ops"))]);
    assert_eq!(
        store.decide_held("2026-11", Decision::Apply, "ops", DEC, &none).unwrap(),
        Decided::default(),
        "decided once"
    );
    assert!(!store.is_final("2026-11").unwrap());
    assert_eq!(store.totals("2026-11", Some("k3")).unwrap()[0].billable, 2);
    assert!(
        !store.reconcile("2026-11", after).unwrap().unwrap().is_final,
        "a new node reopens nothing but is not reported"
    );
    store.put_counters(&own("c", 2, &[("k3", [0, 5, 0, 0, 0])], &[(2, 2)]), DEC).unwrap();
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(r.is_final, "{r:?}");
    let node_c = r.nodes.iter().find(|n| n.node == "c").unwrap();
    assert_eq!((node_c.calls, node_c.own_calls, node_c.corrected), (2, Some(5), 3), "{r:?}");
    assert_eq!(r.billable, 4 + 5);
    let k3 = |store: &UsageStore| store.totals("2026-11", Some("k3")).unwrap()[0].billable;
    assert_eq!(k3(&store), 5);
    // Reconciling again changes nothing.
    assert_eq!(store.reconcile("2026-11", after).unwrap().unwrap().billable, 9);
    // The window comes after all (it was late, not lost): the correction is taken back.
    store.apply(&[c(2, DEC - 10, 3)], DEC, &none).unwrap();
    assert!(store.is_final("2026-11").unwrap(), "held");
    assert_eq!(k3(&store), 5);
    store.decide_held("2026-11", Decision::Apply, "ops", DEC, &none).unwrap();
    assert!(!store.is_final("2026-11").unwrap());
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    let node_c = r.nodes.iter().find(|n| n.node == "c").unwrap();
    assert_eq!((r.is_final, node_c.corrected, r.billable, k3(&store)), (true, 0, 9, 5), "{r:?}");
    // Held and applied: node c's first window (November was final then) and this one.
    assert_eq!(r.late_windows, 2);
    // A changed report of a final period is held, never stored on its own; an older or
    // the same one changes nothing.
    let mut k3_changed = own("c", 2, &[("k3", [0, 7, 0, 0, 0])], &[(2, 2)]);
    assert_eq!(store.put_counters(&k3_changed, DEC).unwrap(), Counted::Held);
    assert_eq!(store.put_counters(&own("c", 1, &[("k3", [0, 9, 0, 0, 0])], &[]), DEC).unwrap(), Counted::Stored);
    assert!(store.is_final("2026-11").unwrap());
    assert_eq!(store.counters("c", "2026-11").unwrap().map(|c| c.calls()), Some(5), "the report kept is unchanged");
    assert_eq!(store.reconcile("2026-11", after).unwrap().unwrap().billable, 9);
    let held_now = store.held().unwrap();
    let waiting = held_now.iter().find(|h| h.state == "held").unwrap();
    assert_eq!((waiting.parts, waiting.reports, &waiting.nodes), (0, 1, &vec!["c".to_owned()]));
    // A newer change replaces the one held; the platform applies it: the period reopens
    // and the next reconcile bills the node's count.
    k3_changed.rows[0].status[1] = 6;
    store.put_counters(&k3_changed, DEC).unwrap();
    let d = store.decide_held("2026-11", Decision::Apply, "ops", DEC, &none).unwrap();
    assert_eq!(d, Decided { parts: 0, reports: 1 });
    assert!(!store.is_final("2026-11").unwrap());
    assert_eq!(store.counters("c", "2026-11").unwrap().map(|c| c.through), Some(2));
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert_eq!((r.is_final, r.billable, k3(&store)), (true, 10, 6), "{r:?}");
    // A node that counts less than the store applied (its counters file was lost) is
    // never corrected down.
    store.apply(&[window("d", 1, DEC - 10, vec![row("k4", "search/query", [0, 3, 0, 0, 0], 1)])], DEC, &none).unwrap();
    store.decide_held("2026-11", Decision::Apply, "ops", DEC, &none).unwrap();
    store.put_counters(&own("d", 1, &[("k4", [0, 1, 0, 0, 0])], &[]), DEC).unwrap();
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    let node_d = r.nodes.iter().find(|n| n.node == "d").unwrap();
    assert_eq!((r.is_final, node_d.corrected, node_d.counted_less, r.billable), (true, 0, 2, 13), "{r:?}");
    // Windows numbered past what the counts cover: the node numbers again (held, as the
    // period is final, and discarded by the platform).
    store.apply(&[window("d", 2, DEC - 10, vec![row("k4", "search/query", [0, 1, 0, 0, 0], 1)])], DEC, &none).unwrap();
    assert_eq!(store.decide_held("2026-11", Decision::Discard, "ops", DEC, &none).unwrap().parts, 1);
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(!r.is_final && r.blocking.iter().any(|b| b.contains("numbered past 1")), "{r:?}");
    assert_eq!(r.billable, 13, "a discarded window adds nothing");
    // Retired as of its window 2, node d holds the period up no more.
    let retired = store.retire("d", None, "ops", DEC).unwrap().unwrap();
    assert_eq!((retired.node.as_str(), retired.after, retired.by.as_str()), ("d", 2, "ops"));
    let r = store.reconcile("2026-11", after).unwrap().unwrap();
    assert!(r.is_final && r.waived.iter().any(|b| b.contains("numbered past 1")), "{r:?}");
    let node_d = r.nodes.iter().find(|n| n.node == "d").unwrap();
    assert_eq!((node_d.retired_after, r.billable), (Some(2), 13));
    assert_eq!(store.retired().unwrap(), vec![retired]);
    assert_eq!(store.reconcile("2026-13", after).unwrap().map(|r| r.period), None);
}

fn a_retired_node_sends_nothing_past_its_last_window(db: &TestDb) {
    let store = db.open();
    let none = Quotas::default();
    let w = |seq, start| window("a", seq, start, vec![row("k1", "search/query", [0, 2, 0, 0, 0], 1)]);
    store.apply(&[w(1, DEC), w(2, DEC + 10)], DEC + 20, &none).unwrap();
    let before = store.totals("2026-12", None).unwrap();
    assert!(store.retire("a", Some(1), "ops", DEC).unwrap().unwrap_err().contains("retire it as of 2 or later"));
    assert!(store.retired().unwrap().is_empty(), "a refused retirement records nothing");
    store.retire("a", Some(3), "ops", DEC).unwrap().unwrap();
    assert!(store.retire("a", Some(4), "ops", DEC).unwrap().unwrap_err().contains("already retired as of window 3"));
    assert_eq!(store.retire("a", Some(3), "ops", DEC).unwrap().unwrap().after, 3, "the same retirement again");
    // Window 3 still counts; 4 is refused by rule, and nothing of its batch is applied.
    store.apply(&[w(3, DEC + 20)], DEC + 30, &none).unwrap();
    let e = store.apply(&[w(4, DEC + 30)], DEC + 40, &none).unwrap_err();
    assert!(matches!(&e, ApplyError::Refused(r) if r.rule() == "node_retired"), "{e}");
    let totals = store.totals("2026-12", None).unwrap();
    assert_eq!(totals[0].billable, before[0].billable + 2);
    let refusals = store.refusals().unwrap();
    assert_eq!((refusals[0].rule.as_str(), refusals[0].count, refusals[0].last_seq), ("node_retired", 1, 4));
}

fn own(node: &str, through: u64, rows: &[(&str, [u64; 5])], unavailable: &[(u64, u64)]) -> NodeCounters {
    let c = NodeCounters {
        node: node.into(),
        period: "2026-11".into(),
        through,
        rows: rows
            .iter()
            .map(|(caller, status)| postern_model::usage::CounterRow {
                kind: CallerKind::Key,
                caller: (*caller).into(),
                product: "search".into(),
                status: *status,
            })
            .collect(),
        unavailable: unavailable.to_vec(),
    };
    assert_eq!(c.check(), Ok(()));
    c
}

fn quotas(mode: QuotaMode, calls: u64, every: u64) -> Quotas {
    let plans: BTreeMap<String, Plan> = [(
        "metered".to_owned(),
        Plan {
            products: vec!["search".into()],
            rate_limit: None,
            app_rate_limit: None,
            fail_closed: false,
            quota: Some(Quota { calls, mode, anchor: postern_model::usage::Anchor::EverySeconds(every) }),
            priority: None,
        },
    )]
    .into();
    let mut creds = Credentials::empty();
    creds.keys = vec![postern_model::credentials::ApiKey {
        id: "k1".into(),
        sha256: "ab".repeat(32),
        app: "a".into(),
        tenant: "t".into(),
        plan: "metered".into(),
        scopes: vec![],
        priority: Default::default(),
        status: Default::default(),
        successor: None,
        expires_at: None,
    }];
    Quotas::new(&plans, &creds)
}

fn a_hard_quota_flags_its_caller_and_bills_no_overshoot(db: &TestDb) {
    let store = db.open();
    let q = quotas(QuotaMode::Hard, 100, 60);
    assert!(q.of(CallerKind::Key, "k1").is_some() && q.of(CallerKind::Key, "k2").is_none());
    // 70 calls (and 5 refused ones, not billable), then 15: 80 % is passed.
    let w = |seq, start, ok| window("a", seq, start, vec![row("k1", "search/query", [0, ok, 0, 5, 0], 4)]);
    store.apply(&[w(1, DEC, 70)], DEC, &q).unwrap();
    assert_eq!(store.events(0, 10, None).unwrap(), vec![], "70 of 100: nothing yet");
    store.apply(&[w(2, DEC + 10, 15)], DEC + 11, &q).unwrap();
    let events = store.events(0, 10, None).unwrap();
    assert_eq!(events.iter().map(|e| (e.percent, e.used)).collect::<Vec<_>>(), vec![(80, 85)]);
    assert_eq!(store.live_flags(DEC + 12).unwrap(), vec![], "not flagged below 100 %");
    // 30 more: 100 % is passed in this window; 15 of them are overshoot. A duplicate
    // delivery of it changes nothing.
    store.apply(&[w(3, DEC + 20, 30)], DEC + 21, &q).unwrap();
    store.apply(&[w(3, DEC + 20, 30)], DEC + 22, &q).unwrap();
    let events = store.events(0, 10, None).unwrap();
    assert_eq!(
        events.iter().map(|e| (e.percent, e.kind.as_str())).collect::<Vec<_>>(),
        vec![(80, "quota.warning"), (100, "quota.exhausted")]
    );
    let flags = store.live_flags(DEC + 22).unwrap();
    assert_eq!(flags.len(), 1);
    assert_eq!(
        (flags[0].caller.as_str(), flags[0].until, flags[0].quota, flags[0].period_s),
        ("k1", DEC + 60, 100, 60)
    );
    assert_eq!(store.live_flags(DEC + 60).unwrap(), vec![], "the flag lifts at the period's end");
    // Calls admitted before the flag reached the nodes: overshoot, not billed.
    store.apply(&[w(4, DEC + 30, 4)], DEC + 31, &q).unwrap();
    let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
    assert_eq!((t.billable, t.overshoot, t.calls), (100, 19, 119 + 20));
    assert_eq!(store.quota_use("k1", CallerKind::Key, "search", DEC + 30).unwrap(), Some((119, DEC, DEC + 60)));
    // The next period starts from nothing.
    store.apply(&[w(5, DEC + 60, 10)], DEC + 61, &q).unwrap();
    assert_eq!(store.quota_use("k1", CallerKind::Key, "search", DEC + 60).unwrap(), Some((10, DEC + 60, DEC + 120)));
    let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
    assert_eq!((t.billable, t.overshoot), (110, 19));
    // The webhook's bookkeeping: an event taken is not offered again.
    let due = store.events(0, 10, Some(DEC + 100)).unwrap();
    assert_eq!(due.len(), 2);
    store.delivered(due[0].id, true, 0).unwrap();
    store.delivered(due[1].id, false, DEC + 200).unwrap();
    assert_eq!(store.events(0, 10, Some(DEC + 100)).unwrap(), vec![], "one taken, one not due yet");
    assert_eq!(store.events(0, 10, Some(DEC + 200)).unwrap().len(), 1);
}

fn an_overage_quota_warns_and_bills_everything(db: &TestDb) {
    let store = db.open();
    let q = quotas(QuotaMode::Overage, 10, 60);
    store.apply(&[window("a", 1, DEC, vec![row("k1", "search/query", [0, 25, 0, 0, 0], 4)])], DEC, &q).unwrap();
    assert_eq!(store.events(0, 10, None).unwrap().iter().map(|e| e.percent).collect::<Vec<_>>(), vec![80, 100]);
    assert_eq!(store.live_flags(DEC).unwrap(), vec![], "overage is never blocked");
    let t = &store.totals("2026-12", Some("k1")).unwrap()[0];
    assert_eq!((t.billable, t.overshoot), (25, 0));
}

fn a_node_may_report_only_what_it_could_have_counted(db: &TestDb) {
    let store = db.open();
    let q = quotas(QuotaMode::Hard, 100, 60);
    let ok = |seq, start| window("a", seq, start, vec![row("k1", "search/query", [0, 5, 0, 0, 0], 4)]);
    store.apply(&[ok(1, DEC), ok(2, DEC + 10)], DEC + 20, &q).unwrap();
    let before = (store.totals("2026-12", None).unwrap(), store.live_flags(DEC + 20).unwrap(), store.nodes().unwrap());
    let rule = |r: Result<UsageAck, ApplyError>| match r {
        Err(ApplyError::Refused(e)) => e.rule(),
        other => panic!("not refused: {other:?}"),
    };
    // The year 10000, with a million calls: in the future, and no flag for anyone.
    let far = window("a", 3, 253_402_300_800, vec![row("k1", "search/query", [0, 1_000_000, 0, 0, 0], 4)]);
    assert_eq!(rule(store.apply(&[far], DEC + 20, &q)), "future_window");
    // A clock a little ahead is allowed; more than CLOCK_ALLOWANCE_S is not.
    assert_eq!(rule(store.apply(&[ok(3, DEC + 20 + CLOCK_ALLOWANCE_S + 10)], DEC + 20, &q)), "future_window");
    // A number far above the node's highest.
    assert_eq!(rule(store.apply(&[ok(3 + MAX_SEQ_GAP, DEC + 20)], DEC + 20, &q)), "seq_gap");
    // Back-dated behind its own earlier window, or ahead of a later one.
    assert_eq!(rule(store.apply(&[ok(3, DEC - 10)], DEC + 20, &q)), "time_order");
    store.apply(&[ok(5, DEC + 40)], DEC + 40, &q).unwrap();
    assert_eq!(rule(store.apply(&[ok(4, DEC + 50)], DEC + 50, &q)), "time_order");
    // One refused window refuses its whole batch: the good one beside it is not applied.
    assert_eq!(rule(store.apply(&[ok(4, DEC + 30), ok(6, DEC - 60)], DEC + 50, &q)), "time_order");
    let after = (store.totals("2026-12", None).unwrap(), store.live_flags(DEC + 50).unwrap(), store.nodes().unwrap());
    assert_eq!(after.0[0].billable, before.0[0].billable + 5, "only window 5 was added");
    assert_eq!((after.1.len(), before.1.len()), (0, 0));
    assert_eq!(after.2[0].last_seq, 5);
    // The same windows in order are taken.
    store.apply(&[ok(3, DEC + 20), ok(4, DEC + 30)], DEC + 50, &q).unwrap();
    let refusals = store.refusals().unwrap();
    let by_rule: Vec<(&str, u64)> = refusals.iter().map(|r| (r.rule.as_str(), r.count)).collect();
    assert_eq!(by_rule, vec![("future_window", 2), ("seq_gap", 1), ("time_order", 3)]);
    assert!(refusals.iter().all(|r| r.node == "a"));
    // A re-send of a window already applied is a duplicate, whatever the clock says now.
    assert_eq!(store.apply(&[ok(1, DEC)], DEC + 1_000_000, &q).unwrap().duplicates, 1);
}

fn batches_applied_as_a_group_are_answered_each_as_if_alone(db: &TestDb) {
    use postern_model::protocol::Missing;
    let store = db.open();
    let q = Quotas::default();
    let w = |node: &str, seq, start, ok| window(node, seq, start, vec![row("k1", "search/query", [0, ok, 0, 0, 0], 4)]);
    let ack = |applied, duplicates, missing: Vec<Missing>| UsageAck { applied, duplicates, missing };
    let billed = |store: &UsageStore| store.totals("2026-12", Some("k1")).unwrap()[0].billable;
    // Three requests in one transaction: node a's window, node b's windows 1 and 3 (2 is
    // lacking), and a re-send of a's window, a duplicate, as it would be after the first.
    let answers = store.apply_group(
        &[vec![w("a", 1, DEC, 5)], vec![w("b", 1, DEC, 3), w("b", 3, DEC + 20, 2)], vec![w("a", 1, DEC, 5)]],
        DEC + 30,
        &q,
    );
    let answers: Vec<UsageAck> = answers.into_iter().map(Result::unwrap).collect();
    assert_eq!(
        answers,
        vec![ack(1, 0, vec![]), ack(2, 0, vec![Missing { node: "b".into(), from: 2, to: 2 }]), ack(0, 1, vec![])]
    );
    assert_eq!(billed(&store), 10);
    // A refused batch in a group is refused alone: the batches beside it are applied, and
    // the refusal is recorded for its node.
    let far = w("c", 1, 253_402_300_800, 1_000_000);
    let answers =
        store.apply_group(&[vec![w("a", 2, DEC + 10, 4)], vec![far], vec![w("b", 2, DEC + 10, 1)]], DEC + 30, &q);
    assert_eq!(answers[0].as_ref().unwrap(), &ack(1, 0, vec![]));
    assert!(matches!(&answers[1], Err(ApplyError::Refused(e)) if e.rule() == "future_window"), "{:?}", answers[1]);
    assert_eq!(answers[2].as_ref().unwrap(), &ack(1, 0, vec![]));
    assert_eq!(billed(&store), 15);
    let refusals: Vec<(String, String, u64)> =
        store.refusals().unwrap().into_iter().map(|r| (r.node, r.rule, r.count)).collect();
    assert_eq!(refusals, vec![("c".to_owned(), "future_window".to_owned(), 1)]);
    assert!(store.nodes().unwrap().iter().all(|n| n.node != "c"), "nothing of node c is applied");
}

fn the_group_commit_answers_every_request_and_adds_each_window_once(db: &TestDb) {
    use std::sync::Arc;
    let store = Arc::new(db.open());
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let intake = Coalescer::start(store.clone());
        // 40 nodes at once, each sending its windows one request at a time, each twice.
        let nodes: Vec<_> = (0..40u64)
            .map(|n| {
                let intake = intake.clone();
                tokio::spawn(async move {
                    let mut acks = Vec::new();
                    for seq in 1..=3 {
                        let rows = vec![row("k1", "search/query", [0, n + 1, 0, 0, 0], 4)];
                        let w = window(&format!("node-{n}"), seq, DEC + seq * 10, rows);
                        for _ in 0..2 {
                            let ack = intake.apply(vec![w.clone()], DEC + 60, Arc::new(Quotas::default())).await;
                            acks.push(ack.unwrap());
                        }
                    }
                    acks
                })
            })
            .collect();
        let once = UsageAck { applied: 1, duplicates: 0, missing: Vec::new() };
        let again = UsageAck { applied: 0, duplicates: 1, missing: Vec::new() };
        for node in nodes {
            let acks = node.await.unwrap();
            assert_eq!(acks, [once.clone(), again.clone(), once.clone(), again.clone(), once.clone(), again.clone()]);
        }
    });
    // Each node's calls, three windows each: 3 × (1 + 2 + … + 40).
    assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, 3 * 820);
    assert_eq!(store.nodes().unwrap().len(), 40);
}

fn a_routes_p999_is_the_bound_of_the_bucket_it_falls_in(db: &TestDb) {
    let store = db.open();
    // 999 answers under 1 ms and 2 in the 50-75 ms bucket: the 1,000th of 1,001 is a slow
    // one. A bucket is named by its bound: 3 ms is in the one up to 5.
    let mut slow = row("k2", "t/search", [0, 2, 0, 0, 0], 60);
    slow.product = "search".into();
    let w = window(
        "a",
        1,
        DEC,
        vec![row("k1", "t/search", [0, 999, 0, 0, 0], 1), slow, row("k1", "u/list", [0, 5, 0, 0, 0], 3)],
    );
    store.apply(&[w], DEC + 20, &Quotas::default()).unwrap();
    let all = store.route_latency(DEC, DEC + 60, None).unwrap();
    assert_eq!(
        all,
        vec![
            RouteLatency { route: "t/search".into(), calls: 1001, p999_ms: Some(75) },
            RouteLatency { route: "u/list".into(), calls: 5, p999_ms: Some(5) },
        ]
    );
    assert_eq!(store.route_latency(DEC, DEC + 60, Some("u")).unwrap().len(), 1);
    assert!(store.route_latency(DEC + 60, DEC + 120, None).unwrap().is_empty());
}

fn a_late_window_of_a_period_already_over_flags_nothing(db: &TestDb) {
    let store = db.open();
    let q = quotas(QuotaMode::Hard, 100, 60);
    let w = |seq, start, ok| window("a", seq, start, vec![row("k1", "search/query", [0, ok, 0, 0, 0], 4)]);
    // 120 calls of the period [DEC, DEC + 60) arrive after it ended: billed up to the
    // quota, no flag on the period that holds now.
    store.apply(&[w(1, DEC + 50, 120)], DEC + 70, &q).unwrap();
    assert_eq!(store.live_flags(DEC + 70).unwrap(), vec![]);
    // In the period that holds now, the same flags until that period's end.
    store.apply(&[w(2, DEC + 60, 120)], DEC + 75, &q).unwrap();
    let flags = store.live_flags(DEC + 75).unwrap();
    assert_eq!(flags.iter().map(|f| f.until).collect::<Vec<_>>(), vec![DEC + 120]);
}

#[test]
fn reconcile_asks_for_runs_whatever_the_counters_claim() {
    let c = |through, unavailable: Vec<(u64, u64)>| NodeCounters {
        node: "a".into(),
        period: "2026-12".into(),
        through,
        rows: vec![],
        unavailable,
    };
    assert!(c(u64::MAX, vec![]).check().is_err(), "through past MAX_SEQ");
    assert!(c(10, vec![(5, u64::MAX)]).check().is_err(), "a run past through");
    assert!(c(10, vec![(3, 4), (6, 10)]).check().is_ok());
    assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59Z");
    assert_eq!(rfc3339(DEC), "2026-12-01T00:00:00Z");
}

fn a_total_past_i64_max_is_refused_never_clamped(db: &TestDb) {
    let store = db.open();
    let ok = |seq, start, n| window("a", seq, start, vec![row("k1", "search/query", [0, n, 0, 0, 0], 4)]);
    store.apply(&[ok(1, DEC, 5)], DEC, &Quotas::default()).unwrap();
    // A total a few calls short of i64::MAX (as a forged node could have pushed it).
    let near = i64::MAX - 3;
    store
        .tx(|sql| sql.exec("UPDATE totals SET billable = ?1, s2 = ?1 WHERE caller = 'k1'", &super::db::vals![near]))
        .unwrap();
    let r = store.apply(&[ok(2, DEC + 10, 5)], DEC + 10, &Quotas::default());
    match r {
        Err(ApplyError::Refused(e)) => assert_eq!(e.rule(), "total_overflow"),
        other => panic!("not refused: {other:?}"),
    }
    // Nothing of it: the total is as it was, an integer, and the window is not applied.
    let t = store.totals("2026-12", Some("k1")).unwrap();
    assert_eq!((t[0].billable, t[0].status.s2), (near as u64, near as u64));
    assert_eq!(store.nodes().unwrap()[0].last_seq, 1);
    let refused: Vec<(String, u64, u64)> =
        store.refusals().unwrap().into_iter().map(|r| (r.rule, r.count, r.last_seq)).collect();
    assert_eq!(refused, vec![("total_overflow".to_owned(), 1, 2)]);
    // Within the bound it still adds.
    store.apply(&[ok(2, DEC + 10, 3)], DEC + 10, &Quotas::default()).unwrap();
    assert_eq!(store.totals("2026-12", Some("k1")).unwrap()[0].billable, i64::MAX as u64);
}

fn a_team_reads_at_most_31_days(db: &TestDb) {
    let store = db.open();
    store
        .apply(&[window("a", 1, DEC, vec![row("k1", "search/query", [0, 2, 0, 0, 0], 4)])], DEC, &Quotas::default())
        .unwrap();
    let q = |to| Query { caller: None, product: None, team: Some("search".into()), from: DEC, to, by: By::Route };
    let rows = store.query(&q(DEC + MAX_TEAM_RANGE_S)).unwrap();
    assert_eq!(rows.iter().map(|r| (r.route.as_str(), r.calls)).collect::<Vec<_>>(), vec![("search/query", 2)]);
    assert!(store.query(&q(DEC + MAX_TEAM_RANGE_S + 1)).is_err());
}

#[test]
fn on_postgres_minutes_are_kept_13_months_and_totals_for_good() {
    let db = TestDb::postgres();
    let store = db.open();
    let pool = store.pool().unwrap();
    // 2025-10-01, fourteen months before December 2026: its minute rows are not kept.
    let old = 1_759_276_800;
    let w = |seq, start| window("a", seq, start, vec![row("k1", "search/query", [0, 3, 0, 0, 0], 4)]);
    store.apply(&[w(1, old)], DEC, &Quotas::default()).unwrap();
    store.apply(&[w(2, DEC)], DEC, &Quotas::default()).unwrap();
    assert_eq!(store.totals("2025-10", None).unwrap()[0].billable, 3);
    let all = Query { caller: None, product: None, team: None, from: 0, to: DEC + 60, by: By::Minute };
    let at: Vec<Option<String>> = store.query(&all).unwrap().into_iter().map(|r| r.at).collect();
    assert_eq!(at, vec![Some("2026-12-01T00:00:00Z".to_owned())]);
    // A partition of a month no longer kept is dropped; the kept ones stay.
    let dec_2025 = 1_764_547_200;
    pool.ensure_month(dec_2025, DEC).unwrap();
    pool.ensure_month(old, old).unwrap();
    assert_eq!(pool.prune(DEC).unwrap(), vec!["2025-10".to_owned()]);
    assert_eq!(super::pg::Pool::first_kept(DEC), dec_2025);
    assert_eq!(store.query(&all).unwrap().len(), 1);
}

/// The usage intake of a fleet: 90 nodes, each sending a 10 s window of 3,000 rows
/// (1,000 callers, 3 routes each; callers are shared between nodes, as a load balancer
/// spreads them), applied by as many workers as the engine runs side by side, while one
/// key's month by route is read over and over. Prints sustained rows/s and the query's
/// latency. `POSTERN_BENCH_WINDOWS` (default 3) windows per node, `POSTERN_BENCH_BATCH`
/// (default 1) windows a transaction; run (BENCHMARKS.md):
/// `cargo test --workspace --lib -- --ignored --nocapture usage_intake_of_a_fleet`.
#[test]
#[ignore = "a benchmark: run by hand, see BENCHMARKS.md"]
fn usage_intake_of_a_fleet() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    const NODES: u64 = 90;
    const CALLERS: usize = 1_000;
    const ROUTES: usize = 3;
    let per_node: u64 = std::env::var("POSTERN_BENCH_WINDOWS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    // Windows a transaction: 1 as the HTTP intake gets them from one node; more as the
    // Kafka consumer takes what the stream holds of several nodes.
    // `group`: the HTTP intake's group commit, one window a request from each of the nodes.
    let batch_var = std::env::var("POSTERN_BENCH_BATCH").unwrap_or_default();
    let grouped = batch_var == "group";
    let batch: usize = batch_var.parse().unwrap_or(1).max(1);
    let now = DEC + 86_400 * 20;
    let window_of = |node: u64, seq: u64| {
        let rows = (0..CALLERS * ROUTES)
            .map(|i| {
                // Each node sees a third of the callers twice over: overlapping keys.
                let caller = (i / ROUTES + node as usize * 333) % 3_000;
                let mut r = row(
                    &format!("key_{caller:06}"),
                    &format!("team{}/route{}", i % ROUTES, i % ROUTES),
                    [0, 6, 0, 1, 0],
                    7,
                );
                r.product = format!("product{}", i % ROUTES);
                r
            })
            .collect();
        window(&format!("node-{node:02}"), seq, now - 86_400 * 19 + seq * 10, rows)
    };
    for (engine, db, workers) in
        [("PostgreSQL", TestDb::postgres(), super::pg::POOL_SIZE), ("SQLite", TestDb::sqlite(), 2)]
    {
        let store = Arc::new(db.open());
        // The windows in the order a fleet sends them: every node's seq 1, then 2, ...
        let jobs: Vec<Window> =
            (1..=per_node).flat_map(|seq| (0..NODES).map(move |n| (n, seq))).map(|(n, s)| window_of(n, s)).collect();
        let rows: usize = jobs.iter().map(|w| w.rows.len()).sum();
        let jobs = Arc::new(jobs);
        let next = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicBool::new(false));
        let reader = {
            let (store, done) = (store.clone(), done.clone());
            std::thread::spawn(move || {
                let q = Query {
                    caller: Some("key_000007".into()),
                    product: None,
                    team: None,
                    from: DEC,
                    to: DEC + 31 * 86_400,
                    by: By::Route,
                };
                let mut lat = Vec::new();
                while !done.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    store.query(&q).unwrap();
                    lat.push(t.elapsed());
                    std::thread::sleep(Duration::from_millis(50));
                }
                lat
            })
        };
        let start = Instant::now();
        if grouped {
            // The HTTP intake: each node ships its next window once the last is answered,
            // through the group commit, on a runtime of the control plane's size.
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async {
                let intake = super::Coalescer::start(store.clone());
                let quotas = Arc::new(Quotas::default());
                let nodes: Vec<_> = (0..NODES as usize)
                    .map(|n| {
                        let (intake, jobs, quotas) = (intake.clone(), jobs.clone(), quotas.clone());
                        tokio::spawn(async move {
                            for w in jobs.iter().skip(n).step_by(NODES as usize) {
                                intake.apply(vec![w.clone()], now, quotas.clone()).await.unwrap();
                            }
                        })
                    })
                    .collect();
                for n in nodes {
                    n.await.unwrap();
                }
            });
        } else {
            let handles: Vec<_> = (0..workers)
                .map(|_| {
                    let (store, jobs, next) = (store.clone(), jobs.clone(), next.clone());
                    std::thread::spawn(move || {
                        loop {
                            let i = next.fetch_add(batch, Ordering::Relaxed);
                            let Some(ws) = jobs.get(i..(i + batch).min(jobs.len())) else { break };
                            if ws.is_empty() {
                                break;
                            }
                            store.apply(ws, now, &Quotas::default()).unwrap();
                        }
                    })
                })
                .collect();
            for h in handles {
                h.join().unwrap();
            }
        }
        let took = start.elapsed();
        done.store(true, Ordering::Relaxed);
        let mut lat = reader.join().unwrap();
        lat.sort();
        let pick = |q: f64| lat.get(((lat.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default();
        let t = store.totals("2026-12", Some("key_000007")).unwrap();
        assert!(!t.is_empty());
        println!(
            "{engine}: {} windows, {} a transaction, {rows} rows in {:.1} s by {workers} workers: {:.0} rows/s; \
             one key's month by route while intake runs: {} reads, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
            jobs.len(),
            if grouped { "grouped".to_owned() } else { batch.to_string() },
            took.as_secs_f64(),
            rows as f64 / took.as_secs_f64(),
            lat.len(),
            pick(0.5).as_secs_f64() * 1e3,
            pick(0.99).as_secs_f64() * 1e3,
            lat.last().copied().unwrap_or_default().as_secs_f64() * 1e3,
        );
    }
}
