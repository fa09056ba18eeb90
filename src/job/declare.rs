//! The macro behind the table of generation parameters in `generation.rs`: everything that names the parameters
//! one by one is generated here from that table, so a new parameter is one entry there.

/// Generates, from one entry per generation parameter (in documentation order):
/// - [`GenerationParams`](super::GenerationParams), a field each, with its `Default`, `for_row` and the
///   serialized form of the job fingerprint;
/// - [`RowParams`](super::RowParams), the same fields as `Option`s, and [`set_row_param`](super::set_row_param),
///   which checks and sets one of them by name;
/// - the job file's `[generation]` section (`GenerationSection`), a key each;
/// - [`PARAMETERS`](super::PARAMETERS) and [`ROW_PARAMETERS`](super::ROW_PARAMETERS): the table as data, from
///   which the source checks per-row columns and the sink builds the results' `params` column.
///
/// An entry reads `name: Type = default, from Column(check), file FileType;` after its doc comment. `Type` is the
/// resolved value's type, which says how the `params` column stores it ([`Stored`](super::Stored)). `Column` is
/// the [`ParamType`](super::ParamType) an input column overriding it must have, and the
/// [`ParamValue`](super::ParamValue) variant such a column gives; `check` turns that value into a `Type` or says
/// what is wrong with it, for columns and the job file alike. `FileType` is the key's type in the job file; its
/// [`FileValue`](super::generation::FileValue) impl turns it into the same `ParamValue`.
macro_rules! generation_parameters {
    ($(
        $(#[doc = $doc:literal])*
        $name:ident: $ty:ty = $default:expr, from $column:ident($check:expr), file $file:ty;
    )*) => {
        /// Sampling and stopping parameters, valid by construction. The names and meanings follow vLLM's
        /// `SamplingParams`. Parameters at their defaults are left out of the serialized form (the job
        /// fingerprint and the manifest), so adding a parameter never changes the fingerprint of a job that does
        /// not use it.
        #[derive(Clone, Debug, PartialEq)]
        pub struct GenerationParams {
            $( $(#[doc = $doc])* pub $name: $ty, )*
        }

        impl Default for GenerationParams {
            /// Greedy decoding of up to 16 tokens, every other parameter off.
            fn default() -> Self {
                GenerationParams { $( $name: $default, )* }
            }
        }

        /// Generation parameters a row sets for itself (from `[input.parameters]` columns); `None` keeps the
        /// job's. Each is checked with the job file's rule when it is read, so a bad value becomes an error row.
        #[derive(Clone, Debug, Default, PartialEq)]
        pub struct RowParams {
            $( $(#[doc = $doc])* pub $name: Option<$ty>, )*
        }

        impl GenerationParams {
            /// The parameters for one row: the job's, with the row's own values where it sets them. Err when the
            /// combination is invalid (a `min_new_tokens` above `max_new_tokens`).
            pub fn for_row(&self, row: &RowParams) -> Result<GenerationParams, String> {
                let p = GenerationParams { $( $name: row.$name.clone().unwrap_or_else(|| self.$name.clone()), )* };
                p.check()?;
                Ok(p)
            }

            /// Every parameter by name, none left out, in table order: the results' `params` column.
            pub fn to_json_object(&self) -> serde_json::Map<String, serde_json::Value> {
                let mut object = serde_json::Map::new();
                $( object.insert(stringify!($name).into(), serde_json::to_value(&self.$name).expect("parameters serialise")); )*
                object
            }

            /// Writes one parameter of the serialized form, or leaves it out at its default.
            fn serialize_field<S: serde::ser::SerializeStruct>(
                &self,
                name: &'static str,
                defaults: &GenerationParams,
                s: &mut S,
            ) -> Result<(), S::Error> {
                let always = $crate::job::generation::ALWAYS_SERIALIZED.contains(&name);
                match name {
                    $( stringify!($name) if always || self.$name != defaults.$name => s.serialize_field(name, &self.$name), )*
                    _ => s.skip_field(name),
                }
            }
        }

        /// Every generation parameter, in documentation order.
        pub const PARAMETERS: &[$crate::job::Parameter] = &[
            $( $crate::job::Parameter {
                name: stringify!($name),
                file_key: concat!("generation.", stringify!($name)),
                column: $crate::job::ParamType::$column,
                stored: <$ty as $crate::job::Stored>::AS,
                nullable: <$ty as $crate::job::Stored>::NULLABLE,
            }, )*
        ];

        /// Every generation parameter a row may set from an input column, in documentation order.
        pub const ROW_PARAMETERS: &[(&str, $crate::job::ParamType)] = &[ $( (stringify!($name), $crate::job::ParamType::$column), )* ];

        /// Checks one per-row value with the job file's rule for its key and sets it; the error says what is
        /// wrong.
        pub fn set_row_param(params: &mut RowParams, key: &str, value: $crate::job::ParamValue) -> Result<(), String> {
            match (key, value) {
                $( (stringify!($name), $crate::job::ParamValue::$column(v)) => params.$name = Some(($check)(v)?), )*
                (key, value) => return Err(format!("cannot take {value:?} (not a per-row parameter of this type: {key})")),
            }
            Ok(())
        }

        /// The job file's `[generation]` section, as written.
        #[derive(Debug, Default, serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        pub(super) struct GenerationSection {
            $( #[serde(default)] pub(super) $name: $file, )*
        }

        impl GenerationSection {
            /// Whether the file sets the parameter `name`.
            pub(super) fn is_given(&self, name: &str) -> bool {
                match name {
                    $( stringify!($name) => $crate::job::generation::FileValue::is_given(&self.$name), )*
                    _ => false,
                }
            }

            /// Every parameter with the value the file gives it (`None` when it gives none), in table order.
            pub(super) fn into_values(self) -> Vec<(&'static str, Result<Option<$crate::job::ParamValue>, String>)> {
                vec![ $( (stringify!($name), $crate::job::generation::FileValue::into_value(self.$name)), )* ]
            }
        }
    };
}
