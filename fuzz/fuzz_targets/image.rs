//! Any bytes as an input image: decoding under the size limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use multihead_models::image_input::decode_image;

fuzz_target!(|data: &[u8]| {
    let _ = decode_image(data, "fuzz.png");
});
