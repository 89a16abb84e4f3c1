#![no_main]

use fedfleet_protocol::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = Message::decode(data) {
        let _ = message.encode();
    }
});
