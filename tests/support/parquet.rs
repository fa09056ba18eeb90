//! Input Parquet: columns of arrays written as one file, in row groups of a chosen size.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use arrow::array::{ArrayRef, RecordBatch};
use arrow::datatypes::{Field, Schema};
use parquet::arrow::ArrowWriter;

pub fn write_parquet(path: &Path, columns: Vec<(&str, ArrayRef)>) {
    write_parquet_groups(path, columns, None)
}

/// Writes Parquet with row groups of at most `group_rows` rows (the writer's default when `None`).
pub fn write_parquet_groups(path: &Path, columns: Vec<(&str, ArrayRef)>, group_rows: Option<usize>) {
    let fields: Vec<Field> = columns.iter().map(|(n, a)| Field::new(*n, a.data_type().clone(), true)).collect();
    let batch = RecordBatch::try_new(Arc::new(Schema::new(fields)), columns.into_iter().map(|(_, a)| a).collect()).unwrap();
    let props = parquet::file::properties::WriterProperties::builder().set_max_row_group_row_count(group_rows).build();
    let mut writer = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), Some(props)).unwrap();
    writer.write(&batch).unwrap();
    writer.close().unwrap();
}

pub fn strings(values: &[Option<&str>]) -> ArrayRef {
    Arc::new(arrow::array::StringArray::from(values.to_vec()))
}

pub fn prompts(ids: &[String], prompts: &[&str]) -> Vec<(&'static str, ArrayRef)> {
    vec![
        ("id", strings(&ids.iter().map(|s| Some(s.as_str())).collect::<Vec<_>>())),
        ("prompt", strings(&prompts.iter().map(|s| Some(*s)).collect::<Vec<_>>())),
    ]
}
