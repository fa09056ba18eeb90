//! The columns of a metrics file, declared once: `unit` and `attempt`, then a column per field of
//! [`JobMetrics`](super::JobMetrics), whose `job_metrics!` declaration gives each its name, type, description
//! (the field's doc comment) and value. The sink builds the schema and the row from [`metrics_columns`], and a
//! test there checks `schemas/metrics.json` against them.

/// The type of a metrics column (the sink maps it to an Arrow type).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricType {
    UInt64,
    Float64,
    /// A `Float64` that may be null.
    NullableFloat64,
    Utf8,
}

/// One value of a metrics row; its variant is its column's [`MetricType`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MetricValue<'a> {
    UInt64(u64),
    Float64(f64),
    NullableFloat64(Option<f64>),
    Utf8(&'a str),
}

/// What a metrics file's one row is about, and its figures.
#[derive(Clone, Copy, Debug)]
pub struct MetricsRow<'a> {
    pub unit: u32,
    pub attempt: &'a str,
    pub metrics: &'a super::JobMetrics,
}

/// One column of the metrics files.
#[derive(Clone, Copy)]
pub struct MetricsColumn {
    pub name: &'static str,
    pub ty: MetricType,
    /// The description's lines, as the doc comment has them.
    pub doc: &'static [&'static str],
    pub read: for<'a> fn(&MetricsRow<'a>) -> MetricValue<'a>,
}

impl MetricsColumn {
    /// The doc comment as one line: `schemas/metrics.json`'s description of the column.
    pub fn description(&self) -> String {
        self.doc.iter().map(|line| line.trim()).collect::<Vec<_>>().join(" ")
    }
}

impl std::fmt::Debug for MetricsColumn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsColumn").field("name", &self.name).field("ty", &self.ty).finish_non_exhaustive()
    }
}

/// The types of [`JobMetrics`](super::JobMetrics) fields: a field of another type is not a column.
pub trait MetricField {
    const TYPE: MetricType;
    fn value(&self) -> MetricValue<'_>;
}

impl MetricField for u64 {
    const TYPE: MetricType = MetricType::UInt64;
    fn value(&self) -> MetricValue<'_> {
        MetricValue::UInt64(*self)
    }
}

impl MetricField for f64 {
    const TYPE: MetricType = MetricType::Float64;
    fn value(&self) -> MetricValue<'_> {
        MetricValue::Float64(*self)
    }
}

impl MetricField for &'static str {
    const TYPE: MetricType = MetricType::Utf8;
    fn value(&self) -> MetricValue<'_> {
        MetricValue::Utf8(self)
    }
}

impl MetricField for String {
    const TYPE: MetricType = MetricType::Utf8;
    fn value(&self) -> MetricValue<'_> {
        MetricValue::Utf8(self)
    }
}

impl MetricField for Option<f64> {
    const TYPE: MetricType = MetricType::NullableFloat64;
    fn value(&self) -> MetricValue<'_> {
        MetricValue::NullableFloat64(*self)
    }
}

/// The columns before the figures: whose figures the row holds.
const KEY_COLUMNS: &[MetricsColumn] = &[
    MetricsColumn {
        name: "unit",
        ty: MetricType::UInt64,
        doc: &["The unit's id in _plan.json."],
        read: |row| MetricValue::UInt64(row.unit.into()),
    },
    MetricsColumn {
        name: "attempt",
        ty: MetricType::Utf8,
        doc: &["The attempt (process start) that wrote this unit."],
        read: |row| MetricValue::Utf8(row.attempt),
    },
];

/// Every column of a metrics file, in order.
pub fn metrics_columns() -> impl Iterator<Item = &'static MetricsColumn> {
    KEY_COLUMNS.iter().chain(super::JobMetrics::COLUMNS)
}

/// Declares [`JobMetrics`](super::JobMetrics) and its [`COLUMNS`](super::JobMetrics::COLUMNS): a column per field,
/// in field order, named as the field, typed by [`MetricField`], described by the field's doc comment.
macro_rules! job_metrics {
    (
        $(#[$meta:meta])*
        pub struct JobMetrics {
            $( $(#[doc = $doc:literal])+ pub $name:ident: $ty:ty, )*
        }
    ) => {
        $(#[$meta])*
        pub struct JobMetrics {
            $( $(#[doc = $doc])+ pub $name: $ty, )*
        }

        impl JobMetrics {
            /// A column of the metrics files per field, in field order (after `unit` and `attempt`).
            pub const COLUMNS: &'static [$crate::metrics::MetricsColumn] = &[
                $( $crate::metrics::MetricsColumn {
                    name: stringify!($name),
                    ty: <$ty as $crate::metrics::MetricField>::TYPE,
                    doc: &[$($doc),+],
                    read: |row| $crate::metrics::MetricField::value(&row.metrics.$name),
                }, )*
            ];
        }
    };
}
